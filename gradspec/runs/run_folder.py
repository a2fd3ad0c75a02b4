"""The run folder of a scoring run: a manifest and one Parquet part per chunk of input rows.

Rows are scored in chunks of consecutive input indices; a chunk's part is written to a temporary
file and renamed, so a part either exists whole or not at all, and a killed run resumes by skipping
the chunks whose part exists. Shards own chunks round-robin, so any number of processes can share
one folder. Merging writes the parts, in input order, into one file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gradspec.runs.score_files import METADATA_KEY, atomic_write, schema_metadata, write_parquet

CHUNK_ROWS = 1024  # input rows per part: the most a kill can cost per process
INPUT_ERROR = "input_error"
_MANIFEST = "manifest.json"
_SHARDS = "shards"  # the manifest's record of how many --shard processes split the run


@dataclass(frozen=True)
class Shard:
    """This process's share of the chunks: chunk c belongs to shard c mod count."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'i/N' as given to --shard."""
        i, sep, n = text.partition("/")
        try:
            shard = cls(int(i), int(n))
        except ValueError:
            shard = None
        if not sep or shard is None or not 0 <= shard.index < shard.count:
            raise ValueError(f"--shard {text!r}: expected i/N with 0 <= i < N, e.g. 0/8")
        return shard

    def owns(self, chunk: int) -> bool:
        return chunk % self.count == self.index


class RunFolder:
    """``<out>.parts/``: manifest.json (the run's config) and NNNNNNNN.parquet, one per chunk."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.path = self.out.with_name(self.out.name + ".parts")

    @property
    def errors_path(self) -> Path:
        """Where merging writes the rows skipped for bad input, one JSON object a line."""
        return self.out.with_suffix(".errors.jsonl")

    def part(self, chunk: int) -> Path:
        return self.path / f"{chunk:08d}.parquet"

    def done(self) -> set[int]:
        if not self.path.is_dir():
            return set()
        return {int(p.stem) for p in self.path.glob("*.parquet") if p.stem.isdigit()}

    def manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / _MANIFEST).read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path / _MANIFEST}: not a run's manifest ({e.msg}, line {e.lineno}); the run "
                             "folder is damaged: --overwrite starts the run again") from None

    def check(self, config: dict[str, Any], resume: bool, overwrite: bool, shards: int = 1) -> None:
        """start's refusals, changing nothing: run before anything slow is loaded. shards: how many
        independent processes (--shard i/N) share the folder; 1 for one process or torchrun."""
        if overwrite:
            return
        if self.out.exists():
            if resume:
                raise FileExistsError(f"{self.out} is already complete: nothing to resume (--overwrite scores it "
                                      "again)")
            raise FileExistsError(f"{self.out} exists; pass --overwrite or choose another --out")
        old = self.manifest()
        if old is None:
            return
        if not resume and shards == 1:
            raise FileExistsError(
                f"{self.path} holds an unfinished run ({len(self.done())} parts done); pass --resume to "
                "continue it or --overwrite to start again"
            )
        if not resume and old.get(_SHARDS, shards) != shards:  # a split the run's other shards do not share
            raise FileExistsError(
                f"{self.path} holds a run split into {old[_SHARDS]} shards, and this is one of {shards}: pass "
                f"--shard i/{old[_SHARDS]} as its other shards did, or --resume to finish its chunks with any split"
            )
        self._same_config(old, config)

    def start(self, config: dict[str, Any], resume: bool, overwrite: bool, shards: int = 1) -> bool:
        """Creates the folder for this config, or checks an existing one against it; returns whether
        this call wrote the manifest.

        An existing folder is continued with resume, replaced with overwrite, and joined without
        either by a shard of a run split the same way (shards); a different config is always refused.
        """
        if overwrite:
            shutil.rmtree(self.path, ignore_errors=True)
            self.out.unlink(missing_ok=True)
            self.errors_path.unlink(missing_ok=True)
        self.check(config, resume, False, shards)
        if self.manifest() is None:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = self.path / f"{_MANIFEST}.tmp{os.getpid()}"
            tmp.write_text(json.dumps({**config, _SHARDS: shards}, indent=1))
            try:
                os.link(tmp, self.path / _MANIFEST)  # fails if another shard got there first
                return True
            except FileExistsError:
                self._same_config(self.manifest(), config)
            finally:
                tmp.unlink()
        return False

    def _same_config(self, old: dict[str, Any], config: dict[str, Any]) -> None:
        differences = [f"{k}: {old.get(k)!r} in the run, {config.get(k)!r} now"
                       for k in sorted((set(old) | set(config)) - {_SHARDS}) if old.get(k) != config.get(k)]
        if differences:
            raise ValueError(f"cannot continue the run in {self.path}, its config differs: " + "; ".join(differences)
                             + "; pass --overwrite to start again with the new config")

    def write_part(self, chunk: int, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
        try:
            keys = dict.fromkeys(k for row in rows for k in row)  # all rows' columns, not the first's
            table = pa.table({k: [row.get(k) for row in rows] for k in keys})
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
            first, last = rows[0]["index"], rows[-1]["index"]
            raise ValueError(f"rows {first}-{last}: a carried input column mixes types ({e})") from None
        write_parquet(table, self.part(chunk), metadata)

    def merge(self, records: int, chunk_rows: int) -> int:
        """Writes all parts into the output file (and the skipped rows into the errors file),
        then removes the folder; returns the rows written. Refuses while a chunk is missing."""
        chunks, done = range(math.ceil(records / chunk_rows)), self.done()
        missing = [c for c in chunks if c not in done]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise RuntimeError(f"{self.path}: {len(missing)} chunks not scored yet ({shown}); finish the run first")
        parts = [self.part(c) for c in chunks]
        schema = pa.unify_schemas([pq.read_schema(p) for p in parts], promote_options="permissive")
        schema = schema.with_metadata({METADATA_KEY: json.dumps(_merged_metadata(parts)).encode()})
        rows = 0
        errors: list[str] = []

        def write(f) -> None:
            nonlocal rows
            with pq.ParquetWriter(f, schema) as writer:
                for p in parts:
                    table = _conform(pq.read_table(p), schema)
                    writer.write_table(table)
                    rows += table.num_rows
                    errors.extend(_error_lines(table))

        atomic_write(self.out, write)  # streamed part by part: the parts need not fit in memory together
        if errors:
            atomic_write(self.errors_path, lambda f: f.write("".join(errors).encode()))
        shutil.rmtree(self.path)
        return rows


def _merged_metadata(parts: list[Path]) -> dict[str, Any]:
    """The run as the first part describes it, with the paths that any part's stages took (on a
    GPU they are measured per process, so they can differ between parts)."""
    described = [schema_metadata(pq.read_schema(p)) for p in parts]
    merged, paths = dict(described[0]), {}
    for d in described:
        for stage, names in d.get("paths", {}).items():
            paths.setdefault(stage, set()).update(names)
    if paths:
        merged["paths"] = {stage: sorted(names) for stage, names in sorted(paths.items())}
    return merged


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table with the merged schema's columns, in its order; columns it lacks are null."""
    columns = [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
               for f in schema]
    return pa.table(columns, schema=schema)


def _error_lines(table: pa.Table) -> Iterator[str]:
    if "error" not in table.column_names:
        return
    for index, status, error in zip(*(table[c].to_pylist() for c in ("index", "status", "error")), strict=True):
        if status == INPUT_ERROR:
            yield json.dumps({"index": index, "error": error}) + "\n"

