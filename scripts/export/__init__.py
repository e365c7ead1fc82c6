"""The export commands: a trained head in the layouts serving engines load, and back. ``python -m scripts.export``
(``command``), importing a published head (``import_head``), publishing an export (``push_to_hub``) and measuring
the engines' served acceptance (``verify_engines``, its engine side and verdicts, ``verify_families``).

The layouts themselves, the model card and the parity figures are the library in ``export/`` (``headstart.export``).
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
