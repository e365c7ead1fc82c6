"""The one error type of the data recipes: a bad record, named by where it came from."""

from __future__ import annotations

from typing import Any


class DataError(ValueError):
    """A record that cannot become a training sample; ``str(err)`` starts with its location.

    Format functions see a bare record, so they raise without a location; the reader that knows the
    file and line attaches it with :meth:`at`.
    """

    def __init__(self, message: str, location: str | None = None):
        super().__init__(f"{location}: {message}" if location else message)
        self.message = message
        self.location = location

    def at(self, location: str) -> DataError:
        return DataError(self.message, location)


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
