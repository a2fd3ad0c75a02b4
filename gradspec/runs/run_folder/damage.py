"""Whether a part found in a run folder is this run's: another config's or other rows' are refused by name,
an unreadable one, or one whose bytes are not those written, is damaged: set aside (a resume scores its
chunk again) or refused (a merge)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gradspec.files import CHECKSUM, checksum_path, checksum_problem, regular
from gradspec.runs.run_folder.config_match import differences
from gradspec.runs.run_folder.fingerprints import FINGERPRINT, PART
from gradspec.runs.score_files import METADATA_KEY


def part_problem(path: Path, chunk: int, fingerprint: str, config: dict[str, Any], records: int | None,
                 chunk_rows: int | None, verify: bool = False,
                 schema: Callable[[pa.Schema], None] | None = None) -> str | None:
    """Why the part at path, chunk's, is not this run's (damaged: it cannot be read; with verify, also its
    bytes are not those written), or None. records, chunk_rows: the run's rows and chunk size (either None:
    the part's rows are not checked). schema: called with the part's schema (read_schema's) where the part
    is this run's but for its bytes, from the footer parsed here (a 7B model's is 1,349 columns: merge
    parses each part's footer once for its checks and schema, once to read it)."""
    try:
        with pq.ParquetFile(regular(path)) as file:
            footer = file.metadata
            arrow = file.schema_arrow if schema is not None else None
        meta = json.loads((footer.metadata or {}).get(METADATA_KEY, b"{}"))
    except FileNotFoundError:
        return None  # moved aside by its owner meanwhile
    except (pa.ArrowException, OSError, ValueError) as e:
        return f"damaged, not a readable Parquet file ({' '.join(str(e).split())})"
    if not isinstance(meta, dict):
        return "damaged, its gradspec metadata is not a mapping"
    if meta.get(FINGERPRINT) != fingerprint:
        if meta.get(FINGERPRINT) is None:
            return "no config fingerprint in its metadata (written by an earlier gradspec, or not by gradspec)"
        found = differences(meta, config, set(config), "in the part", "in the run")
        return "its config differs: " + ("; ".join(found) or
                                         f"fingerprint {meta[FINGERPRINT]} in the part, {fingerprint} in the run")
    if records is not None and chunk_rows is not None:
        chunks = math.ceil(records / chunk_rows)
        if chunk >= chunks:
            return f"chunk {chunk}, but the run has {chunks} chunks ({records} rows, {chunk_rows} a chunk)"
        first, last = chunk * chunk_rows, min((chunk + 1) * chunk_rows, records) - 1
        held = meta.get(PART) or {}
        got = held.get("chunk"), held.get("first_row"), held.get("last_row"), footer.num_rows
        if got != (chunk, first, last, last - first + 1):
            return (f"it holds rows {got[1]}-{got[2]} of chunk {got[0]} ({got[3]} rows), but chunk {chunk} of "
                    f"the run is rows {first}-{last}")
    if schema is not None:
        schema(arrow)
    try:  # last: a part of another run is named as such, not as damaged
        return checksum_problem(path) if verify else None
    except FileNotFoundError:
        return None  # moved aside by its owner meanwhile


def move_aside(path: Path, damaged: Path) -> Path | None:
    """A damaged part (or partial part) and its checksum moved to the folder damaged, under a name not
    taken there; None where it was gone already."""
    damaged.mkdir(exist_ok=True)
    stem, suffix = path.name.split(".", 1)
    name, k = path.name, 0
    while os.path.lexists(damaged / name):
        k += 1
        name = f"{stem}.{k}.{suffix}"
    try:
        os.rename(path, damaged / name)
    except FileNotFoundError:
        return None
    with suppress(FileNotFoundError):
        os.rename(checksum_path(path), damaged / (name + CHECKSUM))
    return damaged / name
