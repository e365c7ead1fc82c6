"""Field checks for the data recipes' records, raising the one bad-record error (``core.errors.DataError``)."""

from __future__ import annotations

from typing import Any

from headstart.core.errors import DataError

__all__ = ["DataError", "get_field"]  # DataError is re-exported: the recipes and formats import it from here


def get_field(record: Any, key: str, kind: type = str, *, required: bool = True, where: str = "") -> Any:
    """``record[key]`` checked to be a ``kind``; an absent or null optional field gives None.

    ``where`` names the nested object (``conversations[2]``) so the error points inside the record.
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(record, dict):
        raise DataError(f"{prefix}expected a JSON object, got {type(record).__name__}")
    value = record.get(key)
    if value is None:
        if required:
            raise DataError(f"{prefix}missing field {key!r} (fields: {sorted(record)})")
        return None
    if not isinstance(value, kind):
        raise DataError(f"{prefix}field {key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value
