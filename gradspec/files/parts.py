"""A folder of numbered Parquet parts beside the file they become, ``<out>.parts/NNNNNNNN.parquet``, and
their compaction into that file. A scoring run writes a part per chunk of input rows and a monitor a part
per step: either way each part is written whole or not at all, a killed writer loses at most the part it
was writing, and nothing of earlier parts is held in memory.

The folder is a LockedFolder (gradspec.files.locks): one writer holds its lock, and only the names it
makes (OURS) are ever deleted there. Compaction writes the parts' rows in row groups of about
GROUP_BYTES, not one a part: each column of a row group has an entry in the file's footer, which every
reader parses whole (1,024-row groups of 1,349 columns: 1.3 GB for a million rows; a row group per
monitored step: a run of 10,000 steps slow to open), and a reader of all columns holds a row group
about 4 times over (pyarrow 26).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gradspec.files.locks import LockedFolder
from gradspec.files.primitives import CHECKSUM, atomic_write

GROUP_BYTES = 64 << 20
PART_NAME = re.compile(r"(\d{8,})\.parquet")  # a part's name: its number, 8 digits at least
SUFFIX = ".parts"  # a parts folder's name: its file's, then this


def parts_folder(out: str | Path) -> Path:
    """Where the parts of ``out`` are kept until they are compacted into it: ``<out>.parts/``."""
    out = Path(out)
    return out.with_name(out.name + SUFFIX)


def part_path(folder: Path, number: int) -> Path:
    return folder / f"{number:08d}.parquet"


def part_numbers(folder: Path) -> list[int]:
    """The numbers of the folder's parts, in order (none where there is no folder)."""
    if not folder.is_dir():
        return []
    return sorted(int(found[1]) for p in folder.iterdir() if (found := PART_NAME.fullmatch(p.name)))


def part_files(folder: Path) -> list[Path]:
    """The folder's parts in the order written (none where there is no folder)."""
    return [part_path(folder, n) for n in part_numbers(folder)]


class PartsFolder(LockedFolder):
    """``<out>.parts/`` of a writer of numbered parts (a scoring run, a monitor): its parts, their
    checksums and its lock; a subclass adds the other names its writer makes to OURS."""

    OURS = re.compile(rf"{PART_NAME.pattern}({re.escape(CHECKSUM)})?")

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        super().__init__(parts_folder(self.out))

    def part(self, number: int) -> Path:
        return part_path(self.path, number)


def widened(schema: pa.Schema | None, other: pa.Schema) -> pa.Schema:
    """schema with other's columns too (schema's first, in its order; a type both have promoted), so
    that parts of one file may differ in columns (a resumed monitor with other modules)."""
    if schema is None:
        return other
    if other.equals(schema):
        return schema
    return pa.unify_schemas([schema, other], promote_options="permissive")


def conformed(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table with the merged schema's columns, in its order; columns it lacks are null."""
    if table.schema.equals(schema, check_metadata=False):  # as every part of one run's is
        return table.replace_schema_metadata(schema.metadata)
    held = dict(zip(table.column_names, table.columns, strict=True))  # by name: table[name] looks through them all
    columns = [held[f.name].cast(f.type) if f.name in held else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.table(columns, schema=schema)


def row_groups(tables: Iterable[pa.Table], nbytes: Callable[[pa.Table], float] | None = None) -> Iterator[pa.Table]:
    """The tables gathered into tables of about GROUP_BYTES, in order. nbytes: a table's size (default:
    its buffers', pyarrow's nbytes)."""
    held: list[pa.Table] = []
    size = 0.0
    for table in tables:
        held.append(table)
        size += table.nbytes if nbytes is None else nbytes(table)
        if size >= GROUP_BYTES:
            yield pa.concat_tables(held)
            held, size = [], 0
    if held:
        yield pa.concat_tables(held)


def write_compacted(out: Path, schema: pa.Schema, tables: Iterable[pa.Table],
                    nbytes: Callable[[pa.Table], float] | None = None, use_dictionary: bool | list[str] = True,
                    before: Callable[[Path], None] | None = None) -> None:
    """tables (of schema) into ``out`` in row groups of about GROUP_BYTES (row_groups), streamed: written
    aside and renamed into place (atomic_write; before: called with the whole file just before)."""

    def write(f) -> None:
        with pq.ParquetWriter(f, schema, use_dictionary=use_dictionary) as writer:
            for group in row_groups(tables, nbytes):
                writer.write_table(group)

    atomic_write(out, write, before=before)
