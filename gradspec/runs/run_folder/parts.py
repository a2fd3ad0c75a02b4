"""A chunk's rows on disk: its part, written once the chunk is scored, and its partial part, the rows
scored so far flushed every --flush-minutes, so that a kill costs the time since the last flush, not the
whole chunk's. Both record the run's config fingerprint and the rows they hold, checksummed."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gradspec.files import checksum_path, checksum_problem, regular
from gradspec.runs.run_folder.damage import move_aside
from gradspec.runs.run_folder.fingerprints import FINGERPRINT, PART
from gradspec.runs.score_files import METADATA_KEY, write_parquet

log = logging.getLogger("gradspec")


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Output rows as a table: every row's columns (not the first's alone), or a ValueError naming the rows
    where a carried input column mixes types."""
    try:
        keys = dict.fromkeys(k for row in rows for k in row)
        return pa.table({k: [row.get(k) for row in rows] for k in keys})
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        first, last = rows[0]["index"], rows[-1]["index"]
        raise ValueError(f"rows {first}-{last}: a carried input column mixes types ({e})") from None


def partial_path(part: Path) -> Path:
    """Where the rows of a part's chunk not finished yet are flushed: NNNNNNNN.partial.parquet."""
    return part.with_name(part.name.replace(".parquet", ".partial.parquet", 1))


def write_part(part: Path, chunk: int, table: pa.Table, metadata: dict[str, Any], fingerprint: str) -> None:
    """A chunk's rows (its index column: the chunk's rows, in order) as its part, with the run's config
    fingerprint and the rows it holds in its metadata; its partial part then goes (its rows are in the part)."""
    index = table["index"]
    held = {"chunk": chunk, "first_row": index[0].as_py(), "last_row": index[-1].as_py()}
    write_parquet(table, part, {**metadata, FINGERPRINT: fingerprint, PART: held}, checksummed=True)
    partial = partial_path(part)
    partial.unlink(missing_ok=True)
    checksum_path(partial).unlink(missing_ok=True)


def write_partial(path: Path, chunk: int, rows: list[dict[str, Any]], fingerprint: str) -> None:
    """The rows of an unfinished chunk scored so far, with the run's config fingerprint and its chunk,
    checksummed as a part is."""
    write_parquet(rows_table(rows), path, {FINGERPRINT: fingerprint, PART: {"chunk": chunk}}, checksummed=True)


def read_partial(path: Path, chunk: int, fingerprint: str, damaged: Path) -> list[dict[str, Any]]:
    """The rows a killed run scored of a chunk before it could finish it, vetted as a part is (its
    checksum, its config fingerprint, its chunk): none where it left none; one of another config is
    removed, a damaged one moved aside to the folder damaged, and their rows are scored again."""
    if not os.path.lexists(path):
        return []
    why, table = checksum_problem(path), None
    if why is None:
        try:
            table = pq.read_table(regular(path))
            meta = json.loads((table.schema.metadata or {}).get(METADATA_KEY, b"{}"))
        except (pa.ArrowException, OSError, ValueError) as e:
            why = f"damaged, not a readable Parquet file ({' '.join(str(e).split())})"
    if why is None and (not isinstance(meta, dict) or meta.get(FINGERPRINT) != fingerprint
                        or (meta.get(PART) or {}).get("chunk") != chunk):
        path.unlink(missing_ok=True)  # another config's, or another chunk's: not this run's rows
        checksum_path(path).unlink(missing_ok=True)
        return []
    if why is not None:
        aside = move_aside(path, damaged)
        log.warning("%s: %s; moved to %s, its rows are scored again", path, why, aside)
        return []
    rows = table.to_pylist()
    for name in table.column_names:  # a list column as the arrays it was written from (their dtype kept)
        if pa.types.is_list(table.schema.field(name).type):
            for row, value in zip(rows, table.column(name).to_numpy(zero_copy_only=False), strict=True):
                row[name] = value
    # a value left unset (None: a row not scored has no metrics yet) is set again as a fresh row's is
    return [{k: v for k, v in row.items() if v is not None} for row in rows]
