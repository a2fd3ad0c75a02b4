"""A spectral monitor's rows on disk: one Parquet part per monitored step in ``<out>.parts/``
(``NNNNNNNN.parquet``, numbered in the order written, as a scoring run's folder is) while the run goes on,
compacted into ``out`` at its end.

Each part is written aside and renamed (atomic_write), so a run killed at any moment leaves whole parts:
it loses at most the step it was writing. Each step costs the same write whatever the run's length, and
nothing of earlier steps is held in memory (the whole-file rewrite this replaces grew quadratically in
I/O and linearly in memory). ``read_monitor`` reads either form as one table; parts whose columns differ
(a resumed run with other modules) are joined, a column a part lacks null in its rows.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gradspec.data.errors import InputError
from gradspec.files import atomic_write
from gradspec.runs.run_folder import conformed

_PART = re.compile(r"^(\d{8,})\.parquet$")
_TEMPORARY = re.compile(r"^\d{8,}\.parquet\.tmp\d+$")  # a part whose write was killed (atomic_write's temporary)
# Compaction writes its row groups at about this size: a row group per part would give a run of 10,000
# steps a footer of 10,000 groups' column statistics, slow to open.
GROUP_BYTES = 64 << 20
READ_TOGETHER = 64


def parts_folder(out: str | Path) -> Path:
    """Where a monitor writing ``out`` keeps its parts until the run's end: ``<out>.parts/``."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def part_path(folder: Path, number: int) -> Path:
    return folder / f"{number:08d}.parquet"


def part_files(folder: Path) -> list[Path]:
    """The folder's parts in the order written (none where there is no folder)."""
    if not folder.is_dir():
        return []
    numbered = [(int(m[1]), p) for p in folder.iterdir() if (m := _PART.match(p.name))]
    return [p for _, p in sorted(numbered)]


def next_part(folder: Path) -> int:
    """The number of the next part to write in the folder."""
    parts = part_files(folder)
    return int(_PART.match(parts[-1].name)[1]) + 1 if parts else 0


def remove_parts(folder: Path) -> None:
    """The parts and killed writes' temporaries gone, and the folder with them if nothing else is in it:
    a user's own files there stay, and no folder is followed through a symbolic link."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for p in folder.iterdir():
        if _PART.match(p.name) or _TEMPORARY.match(p.name):
            p.unlink(missing_ok=True)
    if not any(folder.iterdir()):
        folder.rmdir()


def read_monitor(path: str | Path) -> pd.DataFrame:
    """A spectral monitor's rows as one table, whether its run has ended (the file) or not (the parts
    written so far: a run killed, or not closed yet).

    Args:
        path: The monitor's ``out`` (under torch.distributed a rank's: ``<name>.rank<r>.parquet``), or
            its parts folder ``<out>.parts``.

    Returns:
        One row per sample of each monitored step, in the order written; where parts have other
        columns (a resumed run with other modules), every column, null in the rows of a part without it.

    Raises:
        InputError: No monitor file there, nor parts.
    """
    path = Path(path)
    if path.is_file():  # a finished run's (a compaction cut short before its parts were removed: the file has them)
        return pq.read_table(path).to_pandas()
    folder = path if path.is_dir() else parts_folder(path)
    parts = part_files(folder)
    if not parts:
        raise InputError(f"{path}: no monitor file, nor its parts ({folder}); under torch.distributed each rank "
                         "writes its own: <name>.rank<r>.parquet")
    return pa.concat_tables(list(_groups(parts, _schema(parts)))).to_pandas()


def compact(out: Path) -> None:
    """The parts into ``out`` (written aside, then renamed), streamed part by part in row groups of
    about GROUP_BYTES, never all in memory; then the parts removed. Without parts: nothing."""
    folder = parts_folder(out)
    parts = part_files(folder)
    if not parts:
        return
    schema = _schema(parts)

    def write(f) -> None:
        with pq.ParquetWriter(f, schema) as writer:
            for group in _groups(parts, schema):
                writer.write_table(group)

    atomic_write(out, write)
    remove_parts(folder)  # a kill before this leaves parts the file holds: read_monitor and a resume take the file


def _schema(parts: list[Path]) -> pa.Schema:
    """Every part's columns, in the order they first appear (parts of a resumed run may have others)."""
    schema = pq.read_schema(parts[0])
    for p in parts[1:]:  # one at a time: 10,000 schemas of 100 columns held at once are 250 MB
        other = pq.read_schema(p)
        if not other.equals(schema):
            schema = pa.unify_schemas([schema, other], promote_options="permissive")
    return schema


def _groups(parts: list[Path], schema: pa.Schema) -> Iterator[pa.Table]:
    """The parts conformed to the schema, gathered into tables of about GROUP_BYTES. A part as read holds
    far more memory than its rows (measured: ~150 KB for 6 KB of rows), so every READ_TOGETHER parts
    are copied into one block at once and the parts' own buffers freed."""
    blocks: list[pa.Table] = []
    read: list[pa.Table] = []
    size = 0
    for i, p in enumerate(parts, 1):
        read.append(conformed(pq.ParquetFile(p).read(), schema))
        if len(read) < READ_TOGETHER and i < len(parts):
            continue
        blocks.append(pa.concat_tables(read).combine_chunks())
        read, size = [], size + blocks[-1].nbytes
        if size >= GROUP_BYTES or i == len(parts):
            yield pa.concat_tables(blocks)
            blocks, size = [], 0


def keep_steps(out: Path, upto: float) -> int:
    """A resumed run's rows: those of steps up to ``upto`` kept, later ones dropped (they are trained
    again). A finished run's file goes back into the folder as its first part, so the run goes on
    adding parts. Returns the number of the next part.

    Raises:
        ValueError: out or a part is not a monitor's (no step column).
    """
    folder = parts_folder(out)
    if out.exists():
        _check_monitor_file(out)
        remove_parts(folder)  # left by a compaction cut short after its file was in place: the file has their rows
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(out, part_path(folder, 0))
    for p in part_files(folder):
        _check_monitor_file(p)
        if math.isinf(upto):
            continue
        steps = pc.min_max(pq.read_table(p, columns=["step"])["step"])
        if steps["min"].as_py() is None or steps["max"].as_py() <= upto:
            continue
        if steps["min"].as_py() > upto:
            p.unlink()
        else:  # the finished run's file: filtered row group by row group
            atomic_write(p, lambda f, p=p: _write_steps_upto(p, f, upto))
    if folder.is_dir():
        for p in folder.iterdir():
            if _TEMPORARY.match(p.name):
                p.unlink(missing_ok=True)
    return next_part(folder)


def _write_steps_upto(path: Path, f, upto: float) -> None:
    source = pq.ParquetFile(path)
    with pq.ParquetWriter(f, source.schema_arrow) as writer:
        for i in range(source.num_row_groups):
            group = source.read_row_group(i)
            writer.write_table(group.filter(pc.less_equal(group["step"], upto)))


def _check_monitor_file(path: Path) -> None:
    if "step" not in pq.read_schema(path).names:
        raise ValueError(f"out {path}: not a monitor file (no step column); give the resumed run's own monitor "
                         "file, or another path")
