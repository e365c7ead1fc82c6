"""A trained head in the layouts serving engines load, and back: ``python -m scripts.export`` (``command``).

One module per head type maps our head folder to each engine layout it serves and a published checkpoint back
(``eagle``, ``eagle3``, ``medusa``, ``dflash``: their formats, ``formats.py`` the protocol they implement); beside
them the model card (``card``), the served-parity figures it carries (``parity``, measured by
``verify_engines``), importing a published head (``import_head``) and publishing an export (``push_to_hub``).
"""

from headstart.scripts.export.command import main, run

__all__ = ["main", "run"]
