"""An input's rows cut into gradspec's chunks (index // chunk_rows), each read on its own, from JSON, JSONL and
Parquet files or folders of them on any filesystem pyarrow reaches (a local path, s3://, gs://, hdfs://, ...).

``plan`` reads what the cut needs once, on one machine: each Parquet file's footer (its row count), each
JSONL file's lines (the byte offset of each chunk's first line: one pass over its bytes, none parsed), each
JSON file whole. ``read_chunk`` then reads one chunk's rows anywhere, as gradspec's readers read them
(gradspec.data.formats): the same records, the same per-row problems (a malformed JSON line, a Parquet
value that will not convert) in their row's place, and the same locations in their messages ("file:line",
"file row i", "file element i"). A folder's files are read in the order of their paths, those whose name
starts with "." or "_" (_SUCCESS, .crc) left out.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradspec.data.errors import InputError
from gradspec.data.formats import Record, parquet_records, parse_json, require_object
from gradspec.files import parquet_errors

SUFFIXES = (".json", ".jsonl", ".parquet")
_READ_BYTES = 1 << 20  # the buffer a JSONL file is read through


@dataclass(frozen=True)
class Piece:
    """Consecutive rows of one file: rows [first, first + rows) of it; for JSONL, where the first of them starts
    (offset: its byte, lineno: its line, counting blank lines)."""

    filesystem: Any  # a pyarrow.fs.FileSystem
    path: str  # in filesystem
    label: str  # how messages name the file
    first: int
    rows: int
    offset: int = 0
    lineno: int = 1

    @property
    def kind(self) -> str:
        return os.path.splitext(self.path)[1]


@dataclass(frozen=True)
class Chunk:
    """The rows of one chunk, number, from the input's row start on, held by one or more files' pieces."""

    number: int
    start: int
    pieces: tuple[Piece, ...] = field(default_factory=tuple)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.label for p in self.pieces))


def resolve(data: str) -> tuple[Any, str, str]:
    """(filesystem, path in it, the prefix that names its paths in messages) of a local path or a URI."""
    from pyarrow import fs

    if "://" not in data:
        return fs.LocalFileSystem(), os.path.abspath(data), ""
    filesystem, path = fs.FileSystem.from_uri(data)
    return filesystem, path, data[:data.index("://") + 3]


def input_files(data: str) -> list[tuple[Any, str, str]]:
    """(filesystem, path, label) of each file of the input: data itself, or a folder's JSON, JSONL and
    Parquet files in the order of their paths; an InputError naming data where there is none."""
    from pyarrow import fs

    filesystem, path, prefix = resolve(data)
    info = filesystem.get_file_info(path)
    if info.type == fs.FileType.NotFound:
        raise InputError(f"{data}: no such file or folder")
    if info.type == fs.FileType.Directory:
        found = [i.path for i in filesystem.get_file_info(fs.FileSelector(path, recursive=True))
                 if i.type == fs.FileType.File and i.extension and f".{i.extension}" in SUFFIXES
                 and not any(part.startswith((".", "_")) for part in os.path.relpath(i.path, path).split(os.sep))]
        if not found:
            raise InputError(f"{data}: a folder with no {', '.join(SUFFIXES)} file")
        paths = sorted(found)
    elif os.path.splitext(path)[1] not in SUFFIXES:
        raise InputError(f"{data}: unknown format (expected {', '.join(SUFFIXES)}, or a folder of such files)")
    else:
        paths = [path]
    local = prefix == ""
    return [(filesystem, p, (os.path.relpath(p) if not os.path.isabs(data) else p) if local else prefix + p)
            for p in paths]


def plan(data: str, chunk_rows: int, limit: int | None = None) -> list[Chunk]:
    """The input's chunks, in order: rows [c * chunk_rows, (c + 1) * chunk_rows) of its files taken one after
    the other, up to limit rows."""
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    start = 0  # the input's row at the start of the file being cut

    def cut(rows: int, starts: dict[int, tuple[int, int]], filesystem, path: str, label: str) -> None:
        """Pieces of a file of rows rows (starts: row -> (offset, lineno) of a JSONL file's chunk starts)."""
        nonlocal pieces
        row = 0
        while row < rows:
            index = start + row
            take = min(rows - row, chunk_rows - index % chunk_rows)
            offset, lineno = starts.get(row, (0, 1))
            pieces.append(Piece(filesystem, path, label, row, take, offset, lineno))
            row += take
            if (index + take) % chunk_rows == 0:
                chunks.append(Chunk((index + take) // chunk_rows - 1, index + take - sum(p.rows for p in pieces),
                                    tuple(pieces)))
                pieces = []

    for filesystem, path, label in input_files(data):
        left = None if limit is None else limit - start
        if left is not None and left <= 0:
            break
        kind = os.path.splitext(path)[1]
        if kind == ".parquet":
            rows, starts = _parquet_file(filesystem, path, label).metadata.num_rows, {}
        elif kind == ".json":
            rows, starts = len(_json_rows(filesystem, path, label)), {}
        else:
            rows, starts = _jsonl_starts(filesystem, path, chunk_rows, start, left)
        rows = rows if left is None else min(rows, left)
        cut(rows, starts, filesystem, path, label)
        start += rows
    if pieces:
        chunks.append(Chunk(start // chunk_rows, start - sum(p.rows for p in pieces), tuple(pieces)))
    return chunks


def read_chunk(chunk: Chunk) -> Iterator[tuple[int, str, Record]]:
    """(index in the input, location, record) of each row of a chunk, in order: a record, or the InputError
    confined to its row, as gradspec.data.formats.read_records gives them."""
    index = chunk.start
    for piece in chunk.pieces:
        reader = {".parquet": _parquet_piece, ".json": _json_piece}.get(piece.kind, _jsonl_piece)
        for where, record in reader(piece):
            yield index, where, record
            index += 1


def _lines(filesystem, path: str, offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of each line of a file from offset on, read through a buffer."""
    with filesystem.open_input_file(path) as raw:
        raw.seek(offset)
        for line in io.BufferedReader(raw, _READ_BYTES):
            yield offset, line
            offset += len(line)


def _jsonl_starts(filesystem, path: str, chunk_rows: int, start: int,
                  limit: int | None) -> tuple[int, dict[int, tuple[int, int]]]:
    """(rows of a JSONL file, up to limit; row -> (byte offset, line number) of each row that starts a chunk
    or the file): rows are its lines that are not blank, as readers count them."""
    rows, starts = 0, {}
    for lineno, (offset, line) in enumerate(_lines(filesystem, path), 1):
        if not line.strip():
            continue
        if limit is not None and rows >= limit:
            break
        if rows == 0 or (start + rows) % chunk_rows == 0:
            starts[rows] = (offset, lineno)
        rows += 1
    return rows, starts


def _jsonl_piece(piece: Piece) -> Iterator[tuple[str, Record]]:
    rows = 0
    for lineno, (_, line) in enumerate(_lines(piece.filesystem, piece.path, piece.offset), piece.lineno):
        if rows == piece.rows:
            return
        if not line.strip():
            continue
        where = f"{piece.label}:{lineno}"
        try:
            record: Record = require_object(parse_json(line, where), where)
        except InputError as e:
            record = e
        yield where, record
        rows += 1


def _json_rows(filesystem, path: str, label: str) -> list[Any]:
    """A JSON file's rows: its list, or its one object."""
    with filesystem.open_input_stream(path) as f:
        data = parse_json(f.read(), label, whole_file=True)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InputError(f"{label}: expected a JSON list of objects, got {type(data).__name__}")
    return data


def _json_piece(piece: Piece) -> Iterator[tuple[str, Record]]:
    data = _json_rows(piece.filesystem, piece.path, piece.label)
    for i in range(piece.first, piece.first + piece.rows):
        where = f"{piece.label} element {i}"
        try:
            yield where, require_object(data[i], where)
        except InputError as e:
            yield where, e


def _parquet_file(filesystem, path: str, label: str) -> Any:
    import pyarrow.parquet as pq

    with parquet_errors(label):
        return pq.ParquetFile(filesystem.open_input_file(path))


def _parquet_piece(piece: Piece) -> Iterator[tuple[str, Record]]:
    """The piece's rows: the row groups that hold them read, then cut to them."""
    import pyarrow as pa

    file = _parquet_file(piece.filesystem, piece.path, piece.label)
    groups, first, at = [], None, 0
    for g in range(file.metadata.num_row_groups):
        n = file.metadata.row_group(g).num_rows
        if at + n > piece.first and at < piece.first + piece.rows:
            groups.append(g)
            first = at if first is None else first
        at += n
    with parquet_errors(piece.label):
        table = file.read_row_groups(groups) if groups else pa.table({})
    table = table.slice(piece.first - (first or 0), piece.rows)
    records = parquet_records(table, piece.label, piece.first)
    for k, record in enumerate(records):
        yield f"{piece.label} row {piece.first + k}", record


def describe(chunks: Sequence[Chunk]) -> str:
    """The rows and files of a plan, for a log line."""
    files = dict.fromkeys(f for c in chunks for f in c.files)
    return f"{sum(c.rows for c in chunks)} rows in {len(chunks)} chunks of {len(files)} file(s)"
