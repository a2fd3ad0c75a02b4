"""A finished run's parts into its output file: each part checked against the run first (nothing is
written or deleted where one is not the run's), then their rows streamed in input order into row groups
of about files.parts.GROUP_BYTES, the rows skipped for bad input into <out>.errors.jsonl beside it."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from gradspec.files import atomic_write, is_temporary, regular
from gradspec.files.parts import conformed, widened, write_compacted
from gradspec.options import OptionError, mention
from gradspec.runs.run_folder.damage import part_problem
from gradspec.runs.run_folder.fingerprints import PART, config_fingerprint, run_config
from gradspec.runs.score_files import METADATA_KEY, read_batches, schema_metadata

log = logging.getLogger("gradspec")

INPUT_ERROR = "input_error"  # a row's status where its input was bad (--on-error skip): listed in the errors file


def mergeable(folder: Path, done: set[int], part: Callable[[int], Path], manifest: Callable[[], dict[str, Any] | None],
              records: int, chunk_rows: int, progress: bool = False) -> tuple[list[Path], pa.Schema]:
    """The parts to merge (part(c) for each of the run's chunks c, in order) and their merged schema: each
    part in folder (done: their chunks) checked against the run's manifest (manifest reads it), a missing
    chunk or a part not of the run refused by name. progress: a bar for the checksums."""
    chunks = range(math.ceil(records / chunk_rows))
    missing = [c for c in chunks if c not in done]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise RuntimeError(f"{folder}: {len(missing)} chunks not scored yet ({shown}); finish the run first")
    recorded = manifest()
    if recorded is None:
        raise ValueError(f"{folder}: no run to merge (no manifest.json)")
    config = run_config(recorded)
    fingerprint = config_fingerprint(config)
    checked = tqdm(sorted(done), desc=f"checking {folder.name}", unit="part", disable=not progress,
                   dynamic_ncols=True)
    schema = _MergedSchema()  # sorted(done) is chunks where no part is refused: the schemas come in order
    problems = [f"{part(c).name}: {why}" for c in checked
                if (why := part_problem(part(c), c, fingerprint, config, records, chunk_rows, verify=True,
                                        schema=schema.add)) is not None]
    if problems:
        damaged = any("damaged" in p for p in problems)
        raise OptionError((), f"cannot merge {folder}, nothing was written or deleted: " + "; ".join(problems)
                          + "; move the parts named out of the folder, then score their chunks again with "
                          + mention("resume") + (" (which moves a damaged part aside itself)" if damaged else ""))
    return [part(c) for c in chunks], schema.merged()


def write_merged(out: Path, errors_path: Path, parts: list[Path], schema: pa.Schema, chunk_rows: int,
                 progress: bool = False) -> int:
    """The parts' rows (part c: chunk c's) into out, and those skipped for bad input into errors_path before
    out is renamed into place (once it is, the parts may go); returns the rows written. progress: a bar
    for the parts merged."""
    # a float column's values hardly repeat: a dictionary is tried, then dropped, at twice the time
    dictionary = [f.name for f in schema if not pa.types.is_floating(f.type)]
    rows = 0
    errors: list[str] = []
    row_bytes: float | None = None

    def tables() -> Iterator[pa.Table]:
        nonlocal rows
        with tqdm(parts, desc=f"merging {out.name}", unit="part", disable=not progress, dynamic_ncols=True) as bar:
            for chunk, p in enumerate(bar):
                first, n = chunk * chunk_rows, 0
                for table in _part_batches(p, schema):
                    if table["index"].to_pylist() != list(range(first + n, first + n + table.num_rows)):
                        last = first + pq.read_metadata(p).num_rows - 1
                        raise ValueError(f"cannot merge {p.parent}: {p.name}: its index column is not rows "
                                         f"{first}-{last}; nothing was written or deleted")
                    n += table.num_rows
                    errors.extend(_error_lines(table))
                    yield table
                rows += n

    def nbytes(table: pa.Table) -> float:
        nonlocal row_bytes
        if row_bytes is None:  # a table's nbytes goes through all its buffers: the first one's
            row_bytes = table.nbytes / max(1, table.num_rows)
        return table.num_rows * row_bytes

    def write_errors(_: Path) -> None:
        if errors:
            atomic_write(errors_path, lambda e: e.write("".join(errors).encode()))

    # streamed batch by batch: the parts need not fit in memory together
    write_compacted(out, schema, tables(), nbytes, use_dictionary=dictionary, before=write_errors)
    return rows


def remove_output_temporaries(out: Path, errors_path: Path) -> None:
    """The temporaries of the output and errors files that a killed merge left (atomic_write's): called
    under a whole run's lock, so no live process is writing them."""
    for target in (out, errors_path):
        for p in target.parent.iterdir() if target.parent.is_dir() else ():
            if is_temporary(p.name, target.name) and p.is_file():
                p.unlink(missing_ok=True)
                log.warning("removed %s, left by a merge that was stopped while writing it", p)


def _part_batches(part: Path, schema: pa.Schema) -> Iterator[pa.Table]:
    """A part's rows in batches (read_batches), with the merged schema's columns; a part that cannot
    be read is refused as damaged."""
    try:
        with pq.ParquetFile(regular(part)) as file:
            for table in read_batches(file, None):
                yield conformed(table, schema)
    except (pa.ArrowException, OSError) as e:
        raise OptionError((), f"cannot merge {part.parent}: {part.name}: damaged ({' '.join(str(e).split())}); "
                          f"nothing was written or deleted: move it out of the folder, then "
                          f"{mention('resume')} scores its chunk again") from None


class _MergedSchema:
    """The parts' schemas unified, added in the parts' order, with the run as the first part describes it
    (less the rows the part holds) and the paths that any part's stages took (on a GPU they are measured
    per process, so they can differ between parts). Only one part's schema is held at a time."""

    def __init__(self) -> None:
        self._schema: pa.Schema | None = None
        self._described: dict[str, Any] = {}
        self._paths: dict[str, set[str]] = {}

    def add(self, part: pa.Schema) -> None:
        described = schema_metadata(part)
        if self._schema is None:
            self._described = {k: v for k, v in described.items() if k != PART}
        self._schema = widened(self._schema, part)
        for stage, names in described.get("paths", {}).items():
            self._paths.setdefault(stage, set()).update(names)

    def merged(self) -> pa.Schema:
        merged = dict(self._described)
        if self._paths:
            merged["paths"] = {stage: sorted(names) for stage, names in sorted(self._paths.items())}
        return self._schema.with_metadata({METADATA_KEY: json.dumps(merged).encode()})


def _error_lines(table: pa.Table) -> Iterator[str]:
    if "error" not in table.column_names:
        return
    for index, status, error in zip(*(table[c].to_pylist() for c in ("index", "status", "error")), strict=True):
        if status == INPUT_ERROR:
            yield json.dumps({"index": index, "error": error}) + "\n"
