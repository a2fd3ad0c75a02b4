"""An input's rows as records (dicts), whatever its format: a JSON list, JSONL, Parquet, a `datasets`
folder or Hub name (gradspec.data.hub), or rows given in memory (gradspec.data.in_memory). Errors name
the file and the line or row, and a problem confined to one row comes back in its place, so that the
caller decides to stop or skip.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gradspec.data import hub as hub_datasets
from gradspec.data import in_memory
from gradspec.data.errors import InputError
from gradspec.data.hub import Hub
from gradspec.files import open_regular, parquet_errors, read_bytes, regular

Record = dict | InputError | None  # a record, a problem confined to it, or None: not wanted, not parsed


def read_records(
    path: str | Path, wanted: Callable[[int], bool] | None = None, hub: Hub = Hub()
) -> Iterator[tuple[str, Record]]:
    """(location, record) pairs, one per input row, read as a stream (a JSON list is read whole).

    location is 'file:line' or 'file row i'. Rows that wanted(index) rejects are not parsed; a
    problem confined to one row comes back in its place, so the caller decides to stop or skip.
    A folder, or a name that is no local path but reads as a Hub dataset's, goes to `datasets`
    (gradspec.data.hub: hub says which split, configuration, and whether to stream); the label of
    rows given in memory, to those rows (gradspec.data.in_memory: location 'data[i]').
    """
    if in_memory.is_label(path):
        yield from in_memory.check_held(path).records(wanted)
        return
    if Path(path).is_dir() or hub_datasets.is_dataset_name(str(path)):
        yield from hub_datasets.records(str(path), hub, wanted)
        return
    path = Path(path)
    check_readable(path)
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, wanted or _everything)
    elif path.suffix == ".json":
        yield from _read_json(path)
    else:
        yield from _read_parquet(path, wanted or _everything)


def check_readable(path: str | Path) -> None:
    """What read_records refuses of a path before it reads a row (missing, or of a format it does not
    read), for a caller to refuse before its own slow work (gradspec select reads the scores first)."""
    if in_memory.is_label(path) or Path(path).is_dir() or hub_datasets.is_dataset_name(str(path)):
        return
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder (nor a Hub dataset name: org/name)")
    regular(path, "give a JSON, JSONL or Parquet file, or a dataset folder")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise InputError(f"{path}: unknown format (expected .json, .jsonl, .parquet, a datasets folder "
                         "or a Hub dataset name)")


def _everything(index: int) -> bool:
    return True


def count_records(path: str | Path, hub: Hub = Hub()) -> int:
    """Rows in a dataset without parsing them (a JSON list is parsed)."""
    if in_memory.is_label(path):
        return len(in_memory.check_held(path))
    if Path(path).is_dir() or hub_datasets.is_dataset_name(str(path)):
        return hub_datasets.size(str(path), hub)
    path = Path(path)
    if path.suffix == ".jsonl" and path.is_file():
        with open_regular(path) as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet" and path.is_file():
        return open_parquet(path).metadata.num_rows
    return sum(1 for _ in read_records(path))


def _read_jsonl(path: Path, wanted: Callable[[int], bool]) -> Iterator[tuple[str, Record]]:
    index = 0
    with open_regular(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            index += 1
            if not wanted(index - 1):
                yield where, None
                continue
            try:
                record = require_object(parse_json(raw, where), where)
            except InputError as e:
                record = e
            yield where, record


def parse_json(raw: bytes, where: str, whole_file: bool = False) -> Any:
    """raw's JSON value, or an InputError naming where (and, in a whole file, the line): Python's
    parser also refuses a number of over 4300 digits and nesting deeper than its recursion limit, each
    with an error (ValueError, RecursionError) that would name no file."""
    try:
        return json.loads(raw.decode("utf-8-sig"))  # a BOM (Windows) is fine
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        line = f":{e.lineno}" if whole_file else ""
        raise InputError(f"{where}{line}: malformed JSON: {e.msg} (column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{where}: JSON that Python cannot read ({e})") from None


def read_json(path: str | Path) -> Any:
    """A JSON file's value, read as a regular file; an InputError naming the file (and the line) where it is
    not JSON Python reads."""
    return parse_json(read_bytes(path), str(path), whole_file=True)


def _read_json(path: Path) -> Iterator[tuple[str, Record]]:
    data = read_json(path)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, record in enumerate(data):
        where = f"{path} element {i}"
        try:
            yield where, require_object(record, where)
        except InputError as e:
            yield where, e


def _read_parquet(path: Path, wanted: Callable[[int], bool]) -> Iterator[tuple[str, Record]]:
    row = 0
    for batch in _parquet_batches(path):
        rows = range(row, row + batch.num_rows)
        records = parquet_records(batch, path, row) if any(wanted(i) for i in rows) else [None] * batch.num_rows
        for i, record in zip(rows, records, strict=True):
            yield f"{path} row {i}", record if wanted(i) else None
        row += batch.num_rows


def open_parquet(path: str | Path) -> Any:
    """The Parquet file at path opened (a pyarrow ParquetFile), or an InputError naming it."""
    import pyarrow.parquet as pq

    return _parquet_read(path, lambda: pq.ParquetFile(regular(path)))


def _parquet_batches(path: Path) -> Iterator[Any]:
    """The file's record batches; a corrupt page met on the way is an InputError naming the file."""
    batches = open_parquet(path).iter_batches(batch_size=1024)
    while (batch := _parquet_read(path, next, batches, None)) is not None:
        yield batch


def _parquet_read(path: Path, read: Callable[..., Any], *args: Any) -> Any:
    """read(*args) on the Parquet file at path, pyarrow's errors an InputError naming it, on one line:
    its own, for a truncated or corrupt file ("Parquet magic bytes not found in footer"), name none."""
    with parquet_errors(path):
        return read(*args)


def parquet_records(batch: Any, path: Path, first: int) -> list[Record]:
    """A batch's rows as records; where a value will not convert (a string that is not UTF-8, a
    timestamp beyond Python's dates), which fails the whole batch, each row alone, the bad ones an
    InputError naming the row and column."""
    import pyarrow as pa

    try:
        return batch.to_pylist()
    except (ValueError, OverflowError, pa.ArrowException):
        return [_parquet_record(batch, k, f"{path} row {first + k}") for k in range(batch.num_rows)]


def _parquet_record(batch: Any, k: int, where: str) -> Record:
    import pyarrow as pa

    record = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            record[name] = column[k].as_py()
        except (ValueError, OverflowError, pa.ArrowException) as e:
            return InputError(f"{where}: column {name!r} cannot be read ({e})")
    return record


def require_object(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record
