"""Where records come from: local JSON Lines, JSON and Parquet files, or a Hugging Face hub dataset.

Every record is yielded with its location (``data.jsonl:17``, ``data.json:[3]``, ``data.parquet:row 5``,
``org/name[train]:row 5``; lines count from 1, indices and rows from 0) so that an error can name it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from headstart.core.io import read_jsonl
from headstart.data_recipes.errors import DataError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def read_records(
    source: str, split: str = "train", on_bad_record: Callable[[DataError], None] | None = None
) -> Iterator[tuple[str, dict]]:
    """Yield ``(location, record)`` from ``source``: a local file, else a hub dataset id.

    A JSONL line that is not valid JSON raises DataError, or is handed to ``on_bad_record`` and skipped
    when one is given (a generator cannot go on after raising, so the caller decides here).
    """
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix == ".jsonl":
            yield from read_jsonl(source, on_bad_record)
        elif suffix == ".json":
            yield from _read_json(source, path)
        elif suffix == ".parquet":
            yield from _read_parquet(source, path)
        else:
            raise ValueError(f"{source}: unsupported file type; expected one of {', '.join(FILE_SUFFIXES)}")
    elif path.exists():
        raise ValueError(f"{source} is not a file; name a {', '.join(FILE_SUFFIXES)} file or a hub dataset id")
    elif suffix in FILE_SUFFIXES or source.startswith(("/", "./", "../", "~")):
        # A missing local file must not fall through to the hub: that would turn a typo into a network call.
        raise FileNotFoundError(f"data file not found: {source}")
    else:
        yield from _read_hub(source, split)


def _read_json(source: str, path: Path) -> Iterator[tuple[str, dict]]:
    raw = path.read_bytes()
    try:
        records = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"not UTF-8 text (byte {raw[err.start]:#04x}): re-encode the file as UTF-8", f"{source}:{line}"
        ) from err
    except json.JSONDecodeError as err:
        raise DataError(f"not valid JSON ({err.msg} at column {err.colno})", f"{source}:{err.lineno}") from err
    if not isinstance(records, list):
        raise DataError(f"expected a JSON list of records, got {type(records).__name__}", source)
    for index, record in enumerate(records):
        yield f"{source}:[{index}]", record


def _read_parquet(source: str, path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa  # imported here: only Parquet sources pay for it
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches():
            for record in batch.to_pylist():
                yield f"{source}:row {row}", record
                row += 1
    except (pa.ArrowException, OSError) as err:
        # A truncated download or another format under a .parquet name: the whole file, not one record.
        raise DataError(
            f"not a readable Parquet file after {row} rows ({err}); check or re-download it", source
        ) from err


def _read_hub(source: str, split: str) -> Iterator[tuple[str, dict]]:
    import datasets  # imported here: the hub is the only source that may use the network

    for row, record in enumerate(datasets.load_dataset(source, split=split)):
        yield f"{source}[{split}]:row {row}", record
