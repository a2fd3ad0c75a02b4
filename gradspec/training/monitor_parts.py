"""A spectral monitor's rows on disk: one Parquet part per monitored step in ``<out>.parts/``
(``NNNNNNNN.parquet``, numbered in the order written, as a scoring run's folder is) while the run goes on,
compacted into ``out`` at its end.

Each part is written aside and renamed with its checksum beside it (write_checksummed), so a run killed at
any moment leaves whole parts its checksums accept: it loses at most the step it was writing. Each step costs
the same write whatever the run's length, and nothing of earlier steps is held in memory. The folder is of
one kind with a scoring run's (gradspec.files.parts): one writer holds its run.lock (a live scoring run or
another monitor on the same ``out`` is refused), no link is followed to it, only the monitor's own files are
deleted there, and its parts are compacted as a run's are merged. ``read_monitor`` reads either form as one
table; parts whose columns differ (a resumed run with other modules) are joined, a column a part lacks null
in its rows; a part whose bytes are not those written is refused, naming it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gradspec.data.errors import InputError
from gradspec.files import checksum_path, checksum_problem, is_temporary, regular, write_checksum, write_checksummed
from gradspec.files.parts import (
    PartsFolder,
    conformed,
    part_files,
    part_numbers,
    parts_folder,
    row_groups,
    widened,
    write_compacted,
)

__all__ = ["MonitorParts", "part_files", "parts_folder", "read_monitor"]

READ_TOGETHER = 64


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
        return _read(path).to_pandas()
    folder = path if path.is_dir() else parts_folder(path)
    parts = part_files(folder)
    if not parts:
        raise InputError(f"{path}: no monitor file, nor its parts ({folder}); under torch.distributed each rank "
                         "writes its own: <name>.rank<r>.parquet")
    return pa.concat_tables(list(row_groups(_blocks(parts, _schema(parts))))).to_pandas()


def _schema(parts: list[Path]) -> pa.Schema:
    """Every part's columns, in the order they first appear (parts of a resumed run may have others)."""
    schema = None
    for p in parts:  # one at a time: 10,000 schemas of 100 columns held at once are 250 MB
        schema = widened(schema, _read(p, schema_only=True))
    return schema


def _blocks(parts: list[Path], schema: pa.Schema) -> Iterator[pa.Table]:
    """The parts conformed to the schema, READ_TOGETHER at a time copied into one block: a part as read
    holds far more memory than its rows (measured: ~150 KB for 6 KB of rows), freed by the copy."""
    read: list[pa.Table] = []
    for i, p in enumerate(parts, 1):
        read.append(conformed(_read(p), schema))
        if len(read) >= READ_TOGETHER or i == len(parts):
            yield pa.concat_tables(read).combine_chunks()
            read = []


def _write_steps_upto(path: Path, f, upto: float) -> None:
    with pq.ParquetFile(regular(path)) as source, pq.ParquetWriter(f, source.schema_arrow) as writer:
        for i in range(source.num_row_groups):
            group = source.read_row_group(i)
            writer.write_table(group.filter(pc.less_equal(group["step"], upto)))


def _check_monitor_file(path: Path) -> None:
    if "step" not in _read(path, schema_only=True).names:
        raise ValueError(f"out {path}: not a monitor file (no step column); give the resumed run's own monitor "
                         "file, or another path")


def _read(path: Path, columns: list[str] | None = None, schema_only: bool = False) -> pa.Table | pa.Schema:
    """A monitor file or part (its schema alone with schema_only), read as a regular file; a part whose
    bytes are not those written (its checksum beside it differs) is refused where its rows are read (a
    schema is read from the footer alone: the rows' read checks the bytes, once). A part without a
    checksum (an earlier gradspec's) is read."""
    regular(path)
    if not schema_only and checksum_path(path).exists() and (why := checksum_problem(path)) is not None:
        raise InputError(f"{path}: {why}; move it out of {path.parent} to read the other parts")
    return pq.read_schema(path) if schema_only else pq.read_table(path, columns=columns)


class MonitorParts(PartsFolder):
    """A monitor's ``<out>.parts/``: its numbered parts and their checksums, held by one writer."""

    def __init__(self, out: str | Path) -> None:
        super().__init__(out)
        self.next = 0  # the number of the next part

    def open(self, overwrite: bool, resumed_at: float | None) -> None:
        """Takes the folder's lock (RunLocked while a live scoring run or monitor holds it; a link to the
        folder is refused), then starts a run's parts: an existing file or parts refused unless overwrite
        (then removed: only the monitor's own files); a resumed run's rows up to its checkpoint step
        resumed_at kept."""
        self.acquire()
        try:
            if resumed_at is not None:
                self.next = self._keep_steps(resumed_at)
                return
            if self.out.exists() or part_files(self.path):
                if not overwrite:
                    what = "exists (a previous run's rows)" if self.out.exists() else \
                        f"has parts in {self.path} (an unfinished run's rows)"
                    raise ValueError(f"out {self.out}: {what}; give another path or overwrite=True")
                self.out.unlink(missing_ok=True)
                self.clear()
            self.next = 0
        except BaseException:
            self.release()
            raise

    def write(self, table: pa.Table) -> None:
        """A step's rows as the next part, then its checksum."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_checksummed(self.part(self.next), lambda f: pq.write_table(table, f))
        self.next += 1

    def compact(self) -> None:
        """The parts into ``out`` (write_compacted: streamed part by part, never all in memory); then the
        parts removed and the lock given up. Without parts: the lock given up."""
        try:
            parts = part_files(self.path)
            if parts:
                schema = _schema(parts)
                write_compacted(self.out, schema, _blocks(parts, schema))
                self.clear()  # a kill before this leaves parts the file holds: read_monitor and a resume take the file
        finally:
            self.release()

    def _keep_steps(self, upto: float) -> int:
        """A resumed run's rows: those of steps up to ``upto`` kept, later ones dropped (they are trained
        again). A finished run's file goes back into the folder as its first part, so the run goes on
        adding parts. Returns the number of the next part.

        Raises:
            ValueError: out or a part is not a monitor's (no step column).
        """
        if self.out.exists():
            _check_monitor_file(self.out)
            self.clear()  # left by a compaction cut short after its file was in place: the file has their rows
            self.path.mkdir(parents=True, exist_ok=True)
            os.replace(self.out, self.part(0))
            write_checksum(self.part(0))
        for p in part_files(self.path):
            _check_monitor_file(p)
            if math.isinf(upto):
                continue
            steps = pc.min_max(_read(p, columns=["step"])["step"])
            if steps["min"].as_py() is None or steps["max"].as_py() <= upto:
                continue
            if steps["min"].as_py() > upto:
                p.unlink()
                checksum_path(p).unlink(missing_ok=True)
            else:  # the finished run's file: filtered row group by row group
                write_checksummed(p, lambda f, p=p: _write_steps_upto(p, f, upto))
        for p in self.path.iterdir() if self.path.is_dir() else ():
            if is_temporary(p.name, self.OURS):
                p.unlink(missing_ok=True)
        numbers = part_numbers(self.path)
        return numbers[-1] + 1 if numbers else 0
