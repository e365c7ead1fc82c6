"""A trained head in the layouts serving engines load, and back: ``python -m scripts.export`` (``command``).

One module per head type maps our head folder to each engine layout it serves and a published checkpoint back
(``eagle``, ``eagle3``, ``medusa``, ``dflash``: ``formats.Format`` is the protocol they implement); beside them
the model card (``card``), the served-parity figures it carries (``parity``, measured by ``verify_engines``),
importing a published head (``import_head``) and publishing an export (``push_to_hub``).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # The command's main and run (headstart export), imported when asked for: the engines' side venv imports this
    # package's standard-library modules, and has none of the project's dependencies the command needs (peft).
    if name in ("main", "run"):
        from headstart.scripts.export import command

        return getattr(command, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
