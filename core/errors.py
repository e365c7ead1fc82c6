"""The one bad-record error: a record (a JSON Lines line, a training sample, a benchmark prompt) that
cannot be used, named by where it came from (``data.jsonl:17``)."""

from __future__ import annotations


class DataError(ValueError):
    """A record that cannot be used; ``str(err)`` starts with its location.

    Code that sees a bare record (a data format, a field check) raises without a location; the reader
    that knows the file and line attaches it with :meth:`at`.
    """

    def __init__(self, message: str, location: str | None = None):
        super().__init__(f"{location}: {message}" if location else message)
        self.message = message
        self.location = location

    def at(self, location: str) -> DataError:
        return DataError(self.message, location)
