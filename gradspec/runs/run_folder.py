"""The run folder of a scoring run: a manifest, one Parquet part per chunk of input rows, and the
locks of the processes that work in it.

Rows are scored in chunks of consecutive input indices; a chunk's part is written to a temporary
file and renamed, so a part either exists whole or not at all, and a killed run resumes by skipping
the chunks whose part exists. Shards own chunks round-robin, so any number of processes can share
one folder. Merging writes the parts, in input order, into one file.

Each part records its run's config fingerprint (config_fingerprint: a hash of the manifest's config,
which holds a fingerprint of the model's files beside their resolved folder, recorded but not
compared) and the rows it holds (part: chunk, first_row, last_row). A resume and a merge refuse a
part of another config or of other rows, naming it and what differs, and merging checks that the
parts cover the run's rows exactly once. Each part has a SHA-256 of its bytes beside it, written
after it: a part that cannot be read, or whose bytes do not match (or that has none: its write was
cut short), is damaged; a resume moves it to <out>.damaged/ and scores its chunk again, and a merge
refuses it. Merging deletes the parts it merged and nothing else; a merge killed after its file was
in place leaves parts that the next command on the run removes (the file's fingerprint is theirs).
An --overwrite deletes only what gradspec writes in the folder (parts, checksums, manifest, locks,
temporaries), and no run folder is followed through a symbolic link.

The folder's locks and what guards it (no link followed, only gradspec's own files deleted):
gradspec.files.locks.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from gradspec.files import (
    CHECKSUM,
    atomic_write,
    checksum_path,
    checksum_problem,
    create_new,
    is_temporary,
    open_regular,
    read_text,
    regular,
)
from gradspec.files.locks import LOCK_STALE_S, LockedFolder, RunLocked, Shard  # noqa: F401  (imported from here)
from gradspec.options import OptionError, OptionExists, mention
from gradspec.runs.score_files import METADATA_KEY, read_batches, schema_metadata, write_parquet

log = logging.getLogger("gradspec")

INPUT_ERROR = "input_error"
MODEL_IDENTITY = ("model_path", "model_fingerprint")  # the model a run's config names, as found on disk
# The model's names, recorded and compared only where its fingerprint is not known: the same files under
# another name (./m for m, an absolute path, another node's copy) are the same model
_RECORDED = ("model_path", "model")
# The input files' sizes: recorded, warned about when they change, not refused: fixing a malformed
# row (docs/inputs.md) changes its file, and the parts written before that row stay valid.
_INPUT_SIZES = ("data_bytes", "task_bytes")
NUMERICS = "numerics"  # in the manifest: what the rows' last bits depend on beside the config (runs.numerics)
FINGERPRINT = "config_fingerprint"  # in each part's metadata (and the merged file's): the run's config, hashed
PART = "part"  # in each part's metadata: {"chunk", "first_row", "last_row"}
_MANIFEST = "manifest.json"
_INPUT_END = "input_end.json"  # {"rows": n}: the input (a stream shorter than the limit) held n rows
_SHARDS = "shards"  # the manifest's record of how many --shard processes split the run
_MODEL_SUFFIXES = {".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".gguf", ".py", ".tiktoken"}
_SAMPLE = 1 << 16  # bytes read at each of a model file's start, middle and end for its fingerprint
# A merged file's row groups hold about this much data each, not a part each: each column of a row group has an
# entry in the file's footer, which every reader parses whole (1,024-row groups of 1,349 columns: 1.3 GB for a
# million rows); and a reader of all columns holds a row group about 4 times over (pyarrow 26)
ROW_GROUP_BYTES = 64 << 20



def config_fingerprint(config: dict[str, Any]) -> str:
    """The run's config (a manifest, less its shard count, its input files' sizes and the model's
    names where its fingerprint is known) hashed: 16 hex digits."""
    names = _RECORDED if config.get("model_fingerprint") is not None else ("model_path",)
    body = {k: v for k, v in config.items() if k not in (_SHARDS, *names, *_INPUT_SIZES)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model: str | None) -> dict[str, str] | None:
    """{"model_path": the model's folder, resolved; "model_fingerprint": a hash of its files' names,
    sizes and a few sampled blocks of each (no file is read whole)}, or None where the model is not
    on this machine yet (a Hub id not in the cache, the default model not converted yet). A PEFT
    adapter's fingerprint covers its base model's too. model: as given to --model (None: the default)."""
    folder = _model_folder(model)
    if folder is None:
        return None
    digest = hashlib.sha256()
    try:
        for f in sorted(folder.iterdir()):
            if f.name.startswith(".") or f.suffix not in _MODEL_SUFFIXES or not f.is_file():
                continue
            size = f.stat().st_size
            digest.update(f"{f.name}\0{size}\0".encode())
            with open_regular(f) as handle:
                for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                    handle.seek(at)
                    digest.update(handle.read(_SAMPLE))
        adapter = folder / "adapter_config.json"
        if adapter.is_file():
            base = json.loads(read_text(adapter)).get("base_model_name_or_path")
            inner = model_identity(base) if base else None
            if inner is None:
                return None
            digest.update(inner["model_fingerprint"].encode())
    except (OSError, ValueError):
        return None
    return {"model_path": str(folder), "model_fingerprint": digest.hexdigest()[:16]}


def _model_folder(model: str | None) -> Path | None:
    from gradspec.data.models import DEFAULT_MODEL, cache_dir, names_default

    if names_default(model):  # None, or the default's name: the same weights, the same identity
        converted = cache_dir() / DEFAULT_MODEL
        return converted.resolve() if (converted / "config.json").is_file() else None
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    try:  # a Hub id: its snapshot in the local cache (the folder names the commit)
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001  (not an id the cache knows: no identity yet)
        return None
    return Path(found).parent if isinstance(found, str) else None



class RunFolder(LockedFolder):
    """``<out>.parts/``: manifest.json (the run's config), NNNNNNNN.parquet (one per chunk) and the
    lock files of the processes working in it."""

    OURS = re.compile(r"\d{8}\.(partial\.)?parquet(\.sha256)?|manifest\.json|input_end\.json")
    CLEARED_LAST = ("manifest.json",)  # until it goes, tidy_merged recognises what is left as the merged run's

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        super().__init__(self.out.with_name(self.out.name + ".parts"))
        self._fingerprint: str | None = None

    @property
    def errors_path(self) -> Path:
        """Where merging writes the rows skipped for bad input, one JSON object a line."""
        return self.out.with_suffix(".errors.jsonl")

    @property
    def damaged_path(self) -> Path:
        """Where a resume moves the parts it cannot read before it scores their chunks again."""
        return self.out.with_name(self.out.name + ".damaged")

    def guarded(self) -> tuple[Path, ...]:
        return (self.path, self.damaged_path)

    def part(self, chunk: int) -> Path:
        return self.path / f"{chunk:08d}.parquet"

    def _run_fingerprint(self) -> str:
        """The run's config fingerprint (from its manifest, once), which every part it writes records."""
        if self._fingerprint is None:
            self._fingerprint = config_fingerprint(self.manifest() or {})
        return self._fingerprint

    def partial(self, chunk: int) -> Path:
        """The rows of a chunk not finished yet, written every --flush-minutes (removed with its part)."""
        return self.path / f"{chunk:08d}.partial.parquet"

    def write_partial(self, chunk: int, rows: list[dict[str, Any]]) -> None:
        """The rows of an unfinished chunk scored so far, with the run's config fingerprint and its chunk,
        checksummed as a part is: what a kill costs is then the time since this write, not the whole chunk's."""
        write_parquet(rows_table(rows), self.partial(chunk), {FINGERPRINT: self._run_fingerprint(),
                                                               PART: {"chunk": chunk}}, checksummed=True)

    def partial_rows(self, chunk: int) -> list[dict[str, Any]]:
        """The rows a killed run scored of a chunk before it could finish it, vetted as a part is (its
        checksum, its config fingerprint, its chunk): none where it left none; one of another config is
        removed, a damaged one moved aside to damaged_path, and their rows are scored again."""
        path = self.partial(chunk)
        if not os.path.lexists(path):
            return []
        why, table = checksum_problem(path), None
        if why is None:
            try:
                table = pq.read_table(regular(path))
                meta = json.loads((table.schema.metadata or {}).get(METADATA_KEY, b"{}"))
            except (pa.ArrowException, OSError, ValueError) as e:
                why = f"damaged, not a readable Parquet file ({' '.join(str(e).split())})"
        if why is None and (not isinstance(meta, dict) or meta.get(FINGERPRINT) != self._run_fingerprint()
                            or (meta.get(PART) or {}).get("chunk") != chunk):
            path.unlink(missing_ok=True)  # another config's, or another chunk's: not this run's rows
            checksum_path(path).unlink(missing_ok=True)
            return []
        if why is not None:
            aside = self._move_aside(path)
            log.warning("%s: %s; moved to %s, its rows are scored again", path, why, aside)
            return []
        rows = table.to_pylist()
        for name in table.column_names:  # a list column as the arrays it was written from (their dtype kept)
            if pa.types.is_list(table.schema.field(name).type):
                for row, value in zip(rows, table.column(name).to_numpy(zero_copy_only=False), strict=True):
                    row[name] = value
        # a value left unset (None: a row not scored has no metrics yet) is set again as a fresh row's is
        return [{k: v for k, v in row.items() if v is not None} for row in rows]

    def done(self) -> set[int]:
        if not self.path.is_dir():
            return set()
        return {int(p.stem) for p in self.path.glob("*.parquet") if p.stem.isdigit()}

    def manifest(self, damaged_ok: bool = False) -> dict[str, Any] | None:
        """The run's manifest (None: none yet). A damaged one (a write cut short by a full disk, say)
        is refused, or read as none with damaged_ok (a resume writes it again: the parts are checked
        against the run's config by their own fingerprints, so none is lost)."""
        path = self.path / _MANIFEST
        try:
            manifest = json.loads(read_text(path))
            if isinstance(manifest, dict):
                return manifest
            why = f"a JSON {type(manifest).__name__}, not a mapping"
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            why = f"{e.msg}, line {e.lineno}" if isinstance(e, json.JSONDecodeError) else str(e)
        if damaged_ok:
            log.warning("%s: damaged (%s); written again from this run's config, its parts kept where their "
                        "fingerprints are this run's", path, why)
            return None
        raise OptionError((), f"{path}: not a run's manifest ({why}); the run's parts are intact: pass "
                          f"{mention('resume')} to continue it (the parts of this config are kept, the manifest "
                          "written again)")

    def check(self, config: dict[str, Any], resume: bool, overwrite: bool, shards: int = 1,
              shard: Shard | None = None, unknown: tuple[str, ...] = (), member: bool = False) -> None:
        """start's refusals, run before anything slow is loaded; changes nothing but the leftovers of
        a merge killed after its file was in place (tidy_merged). shards: how many independent
        processes (--shard i/N) share the folder; 1 for one process or torchrun. shard: this process's
        chunks (None: all). unknown: keys of config not known yet (the model's identity before it is on
        this machine), not compared; the parts are then left to start. member: the locks and the parts
        are not checked here (a torchrun rank other than 0: rank 0 holds the lock and checks the parts;
        or start, which does both itself)."""
        self.refuse_links()
        if not member:
            self.refuse_live_owner(Shard() if overwrite or shard is None else shard)
        self.tidy_merged()
        if overwrite:
            return
        if self.out.exists():
            differences = self._out_differences(config, unknown) if resume else []
            if differences:
                raise OptionExists((), f"{self.out} is complete, but of another config: " + "; ".join(differences)
                                   + f"; {mention('overwrite')} scores it again with this one")
            if resume:
                raise OptionExists((), f"{self.out} is already complete: nothing to resume ({mention('overwrite')} "
                                   "scores it again)")
            raise OptionExists((), f"{self.out} exists; pass {mention('overwrite')} or choose another "
                               f"{mention('out')}")
        old = self.manifest(damaged_ok=resume)
        if old is not None:
            if not resume and shards == 1:
                raise OptionExists((), f"{self.path} holds an unfinished run ({len(self.done())} parts "
                                   f"done); pass {mention('resume')} to continue it or {mention('overwrite')} to "
                                   "start again")
            if not resume and old.get(_SHARDS, shards) != shards:  # a split the run's other shards do not share
                raise OptionExists((), f"{self.path} holds a run split into {old[_SHARDS]} shards, and "
                                   f"this is one of {shards}: pass {mention('shard')} i/{old[_SHARDS]} as its other "
                                   f"shards did, or {mention('resume')} to finish its chunks with any split")
            self._same_config(old, config, unknown)
        if not member and not unknown:
            self._vet(config)

    def complete(self, config: dict[str, Any], unknown: tuple[str, ...] = ()) -> bool:
        """Whether out is already this run's merged file (a --resume of it has nothing left to do):
        its recorded config is this one (less the keys unknown yet). What a merge stopped after its
        file was in place left behind is removed (tidy_merged)."""
        if not self.out.is_file() or self._out_differences(config, unknown):
            return False
        self.tidy_merged()
        return True

    def _out_differences(self, config: dict[str, Any], unknown: tuple[str, ...]) -> list[str]:
        recorded = self._out_metadata()
        if isinstance(recorded, str):
            return [recorded]
        config = _as_json(config)
        keys = set(config) - set(unknown) - {NUMERICS}  # a finished file is this run's whatever threads made it
        return _differences(recorded, config, keys, "in the file", "now")

    def _out_metadata(self) -> dict[str, Any] | str:
        """What out records of its run, or why it records nothing readable."""
        try:
            recorded = schema_metadata(pq.read_schema(regular(self.out)))
        except (pa.ArrowException, OSError, ValueError) as e:
            return f"not a score file gradspec wrote ({' '.join(str(e).split())})"
        return recorded if isinstance(recorded, dict) else "its gradspec metadata is not a mapping"

    def tidy_merged(self) -> bool:
        """Removes what a merge killed after its file was in place left behind (the parts it merged,
        their checksums, the manifest; nothing else), so that the run reads as finished; returns
        whether there was any. Only where out's recorded fingerprint is the manifest's."""
        if not self.out.is_file() or not self.path.is_dir() or self.path.is_symlink():
            return False
        manifest, merged = self.manifest(damaged_ok=True), self._out_metadata()
        if manifest is None or isinstance(merged, str) or \
                merged.get(FINGERPRINT) != config_fingerprint({k: v for k, v in manifest.items() if k != _SHARDS}):
            return False
        self.refuse_live_owner(Shard())
        self.clear()
        with suppress(OSError):
            self.path.rmdir()
        log.warning("%s: removed the parts of %s, which a merge stopped before it removed them", self.path, self.out)
        return True

    def start(self, config: dict[str, Any], resume: bool, overwrite: bool, shards: int = 1, *,
              records: int | None = None, shard: Shard | None = None, member: bool = False) -> bool:
        """Takes this process's lock, creates the folder for this config or checks an existing one
        against it, and checks the parts already there; returns whether this call wrote the manifest.

        An existing folder is continued with resume, replaced with overwrite, and joined without
        either by a shard of a run split the same way (shards); a different config is always refused,
        and so is a part of another config or of other rows. records: the rows of the run (None: the
        parts' rows are not checked). shard: this process's chunks (None: all); a part of them that
        is damaged is moved to damaged_path, to be scored again. member: a torchrun rank other
        than 0, which takes no lock and leaves the parts to rank 0. The caller releases the lock
        (release), also when this raises.
        """
        shard = shard or Shard()
        if not member:
            self.acquire(shard, whole=overwrite)
        if overwrite:
            self.clear()
            self.out.unlink(missing_ok=True)
            self.errors_path.unlink(missing_ok=True)
        if not member and shard.count == 1:  # a whole run's lock: no other process writes the output
            self._remove_output_temporaries()
        self.check(config, resume, False, shards, shard, member=True)  # the lock is checked above
        if not member:
            self._vet(config, records, shard)  # before a manifest is written: a refused run leaves none
        config = _as_json(config)
        self._fingerprint = config_fingerprint(config)
        old = self.manifest(damaged_ok=resume)
        if old is not None:  # continued: check() refused any other config, here what may change is said, once
            for k in _INPUT_SIZES:
                if old.get(k) != config.get(k):
                    log.warning("%s: %s was %s bytes when the run started, %s now; the parts already written are "
                                "kept (a fixed row, say), the rest is scored from the file as it is now", self.path,
                                k, old.get(k), config.get(k))
            return False
        self.path.mkdir(parents=True, exist_ok=True)
        if resume:
            (self.path / _MANIFEST).unlink(missing_ok=True)  # a damaged one (manifest): written again
        if create_new(self.path / _MANIFEST, json.dumps({**config, _SHARDS: shards}, indent=1)):
            return True
        self._same_config(self.manifest(), config)  # another shard wrote it first
        return False

    def _same_config(self, old: dict[str, Any], config: dict[str, Any], unknown: tuple[str, ...] = ()) -> None:
        config = _as_json(config)
        differences = _differences(old, config, (set(old) | set(config)) - set(unknown), "in the run", "now")
        if differences and differences == _differences(old, config, {NUMERICS}, "in the run", "now"):
            raise OptionError((), f"cannot continue the run in {self.path} bit for bit: " + differences[0] + "; "
                              + _match(old.get(NUMERICS), config.get(NUMERICS)) + f", or pass {mention('overwrite')} "
                              "to start again")
        if differences:
            raise OptionError((), f"cannot continue the run in {self.path}, its config differs: "
                              + "; ".join(differences) + f"; pass {mention('overwrite')} to start again with the "
                              "new config")

    def input_ended(self, rows: int) -> None:
        """Records that the input held only rows rows (a stream that ended before the run's limit,
        whose size nothing said before): the run's chunks end there, for merge and --resume alike.
        Called as the stream ends, before the part that holds its last row is written."""
        atomic_write(self.path / _INPUT_END, lambda f: f.write(json.dumps({"rows": rows}).encode()))

    def _rows(self, records: int | None) -> int | None:
        """The run's rows: records (planned), or fewer where the input was found to end sooner."""
        try:
            ended = json.loads(read_text(self.path / _INPUT_END))["rows"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return records
        return records if records is None or not isinstance(ended, int) else min(records, ended)

    def _vet(self, config: dict[str, Any], records: int | None = None, shard: Shard | None = None) -> None:
        """Refuses the parts of another config or of other rows (records: the run's rows; None: rows
        unchecked), naming each; moves this shard's unreadable parts aside (shard None: leaves them)."""
        config, records = _as_json(config), self._rows(records)
        fingerprint, chunk_rows = config_fingerprint(config), config.get("chunk_rows")
        chunks = None if records is None or chunk_rows is None else math.ceil(records / chunk_rows)
        problems = []
        for chunk in sorted(self.done()):
            why = self._part_problem(chunk, fingerprint, config, records, chunk_rows,
                                     verify=shard is not None and shard.owns(chunk))
            if why is None:
                continue
            if why.startswith("damaged"):
                if shard is not None and shard.owns(chunk) and chunks is not None and chunk < chunks:
                    aside = self._move_aside(self.part(chunk))
                    if aside is not None:
                        log.warning("%s: %s; moved to %s, its chunk is scored again", self.part(chunk), why, aside)
                continue  # another shard's, or found before the run starts: its owner moves it
            problems.append(f"{self.part(chunk).name}: {why}")
        if problems:
            raise OptionError((), f"cannot continue the run in {self.path}: {_parts(problems)} not of this run: "
                              + "; ".join(problems) + "; move them out of the folder (their chunks are then scored "
                              f"again) or pass {mention('overwrite')} to start again")

    def _part_problem(self, chunk: int, fingerprint: str, config: dict[str, Any], records: int | None,
                      chunk_rows: int | None, verify: bool = False,
                      schema: Callable[[pa.Schema], None] | None = None) -> str | None:
        """Why a part is not this run's (damaged: it cannot be read; with verify, also its bytes are not
        those written), or None. records, chunk_rows: the run's rows and chunk size (either None: the
        part's rows are not checked). schema: called with the part's schema (read_schema's) where the part
        is this run's but for its bytes, from the footer parsed here (a 7B model's is 1,349 columns: merge
        parses each part's footer once for its checks and schema, once to read it)."""
        path = self.part(chunk)
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
            differences = _differences(meta, config, set(config), "in the part", "in the run")
            return "its config differs: " + ("; ".join(differences) or
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
            return checksum_problem(self.part(chunk)) if verify else None
        except FileNotFoundError:
            return None  # moved aside by its owner meanwhile

    def _move_aside(self, path: Path) -> Path | None:
        """A damaged part (or partial part) and its checksum moved to damaged_path, under a name not taken
        there; None where it was gone already."""
        self.damaged_path.mkdir(exist_ok=True)
        stem, suffix = path.name.split(".", 1)
        name, k = path.name, 0
        while os.path.lexists(self.damaged_path / name):
            k += 1
            name = f"{stem}.{k}.{suffix}"
        try:
            os.rename(path, self.damaged_path / name)
        except FileNotFoundError:
            return None
        with suppress(FileNotFoundError):
            os.rename(checksum_path(path), self.damaged_path / (name + CHECKSUM))
        return self.damaged_path / name

    def write_part(self, chunk: int, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
        """A chunk's rows, with the run's config fingerprint and the rows it holds in its metadata."""
        self.write_table(chunk, rows_table(rows), metadata)

    def write_table(self, chunk: int, table: pa.Table, metadata: dict[str, Any]) -> None:
        """write_part of rows already made a table (its index column: the chunk's rows, in order)."""
        index = table["index"]
        held = {"chunk": chunk, "first_row": index[0].as_py(), "last_row": index[-1].as_py()}
        write_parquet(table, self.part(chunk), {**metadata, FINGERPRINT: self._run_fingerprint(), PART: held},
                      checksummed=True)
        self.partial(chunk).unlink(missing_ok=True)  # its rows are in the part
        checksum_path(self.partial(chunk)).unlink(missing_ok=True)

    def merge(self, records: int, chunk_rows: int, progress: bool = False) -> int:
        """Writes all parts into the output file (and the skipped rows into the errors file), then
        deletes the parts and the manifest (and the folder, if nothing else is left in it); returns
        the rows written. Refuses, writing and deleting nothing, while a live process works in the
        folder, a chunk is missing, or a part is not of this run (another config, other rows, beyond
        the run's chunks, unreadable). Reads the parts in batches (read_batches); progress: a bar
        for the checksums and one for the parts merged."""
        if self._lock is None:
            self.acquire(Shard(), whole=True)
        try:
            self._remove_output_temporaries()
            parts, schema = self._mergeable(self._rows(records), chunk_rows, progress)
            rows = self._write_merged(parts, schema, chunk_rows, progress)
            self.clear()  # the parts merged, their checksums, the manifest, killed writes' temporaries
        finally:
            self.release()  # the run is over (or refused): its lock goes, and the folder if it is empty
        if self.path.exists():
            left = sorted(p.name for p in self.path.iterdir())
            log.warning("kept %s: it holds files merge did not write (%s)", self.path, ", ".join(left[:10]))
        return rows

    def _mergeable(self, records: int, chunk_rows: int, progress: bool = False) -> tuple[list[Path], pa.Schema]:
        """The parts to merge, in order, each checked against the manifest, and their merged schema."""
        chunks, done = range(math.ceil(records / chunk_rows)), self.done()
        missing = [c for c in chunks if c not in done]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise RuntimeError(f"{self.path}: {len(missing)} chunks not scored yet ({shown}); finish the run first")
        manifest = self.manifest()
        if manifest is None:
            raise ValueError(f"{self.path}: no run to merge (no manifest.json)")
        config = {k: v for k, v in manifest.items() if k != _SHARDS}
        fingerprint = config_fingerprint(config)
        checked = tqdm(sorted(done), desc=f"checking {self.path.name}", unit="part", disable=not progress,
                       dynamic_ncols=True)
        schema = _MergedSchema()  # sorted(done) is chunks where no part is refused: the schemas come in order
        problems = [f"{self.part(c).name}: {why}" for c in checked
                    if (why := self._part_problem(c, fingerprint, config, records, chunk_rows, verify=True,
                                                  schema=schema.add)) is not None]
        if problems:
            damaged = any("damaged" in p for p in problems)
            raise OptionError((), f"cannot merge {self.path}, nothing was written or deleted: " + "; ".join(problems)
                              + "; move the parts named out of the folder, then score their chunks again with "
                              + mention("resume") + (" (which moves a damaged part aside itself)" if damaged else ""))
        return [self.part(c) for c in chunks], schema.merged()

    def _write_merged(self, parts: list[Path], schema: pa.Schema, chunk_rows: int, progress: bool = False) -> int:
        # a float column's values hardly repeat: a dictionary is tried, then dropped, at twice the time
        dictionary = [f.name for f in schema if not pa.types.is_floating(f.type)]
        rows = 0
        errors: list[str] = []

        def write(f) -> None:
            nonlocal rows
            held: list[pa.Table] = []  # rows not written yet: a row group's worth (ROW_GROUP_BYTES)
            size, row_bytes = 0.0, None
            with pq.ParquetWriter(f, schema, use_dictionary=dictionary) as writer, \
                    tqdm(parts, desc=f"merging {self.out.name}", unit="part", disable=not progress,
                         dynamic_ncols=True) as bar:
                for chunk, p in enumerate(bar):
                    first, n = chunk * chunk_rows, 0
                    for table in self._part_batches(p, schema):
                        if table["index"].to_pylist() != list(range(first + n, first + n + table.num_rows)):
                            last = first + pq.read_metadata(p).num_rows - 1
                            raise ValueError(f"cannot merge {self.path}: {p.name}: its index column is not rows "
                                             f"{first}-{last}; nothing was written or deleted")
                        n += table.num_rows
                        errors.extend(_error_lines(table))
                        held.append(table)
                        if row_bytes is None:  # a table's nbytes goes through all its buffers: the first one's
                            row_bytes = table.nbytes / max(1, table.num_rows)
                        size += table.num_rows * row_bytes
                        if size >= ROW_GROUP_BYTES:
                            writer.write_table(pa.concat_tables(held))
                            held, size = [], 0
                    rows += n
                if held:
                    writer.write_table(pa.concat_tables(held))
            if errors:  # before the output is renamed into place: once it is, the parts may go
                atomic_write(self.errors_path, lambda e: e.write("".join(errors).encode()))

        atomic_write(self.out, write)  # streamed batch by batch: the parts need not fit in memory together
        return rows

    def _part_batches(self, part: Path, schema: pa.Schema) -> Iterator[pa.Table]:
        """A part's rows in batches (read_batches), with the merged schema's columns; a part that cannot
        be read is refused as damaged."""
        try:
            with pq.ParquetFile(regular(part)) as file:
                for table in read_batches(file, None):
                    yield conformed(table, schema)
        except (pa.ArrowException, OSError) as e:
            raise OptionError((), f"cannot merge {self.path}: {part.name}: damaged ({' '.join(str(e).split())}); "
                              f"nothing was written or deleted: move it out of the folder, then "
                              f"{mention('resume')} scores its chunk again") from None

    def abandon(self) -> None:
        """After a failure before any part was written: removes what this process started in the
        folder (and the folder, if that leaves it empty), so the corrected command starts afresh;
        kept if it holds a part or another process's lock. A user's own files there stay."""
        own = None if self._lock is None else self._lock.path
        if self.done() or any(self.path.glob("*.partial.parquet")) or any(p != own for p in self.lock_files()):
            return
        self.clear()
        self.release()

    def _remove_output_temporaries(self) -> None:
        """The temporaries of the output and errors files that a killed merge left (atomic_write's
        <name>.tmp<pid>): called under a whole run's lock, so no live process is writing them."""
        for target in (self.out, self.errors_path):
            for p in target.parent.glob(f"{glob.escape(target.name)}.tmp*"):
                if is_temporary(p.name, target.name) and p.is_file():
                    p.unlink(missing_ok=True)
                    log.warning("removed %s, left by a merge that was stopped while writing it", p)


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Output rows as a table: every row's columns (not the first's alone), or a ValueError naming the rows
    where a carried input column mixes types."""
    try:
        keys = dict.fromkeys(k for row in rows for k in row)
        return pa.table({k: [row.get(k) for row in rows] for k in keys})
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        first, last = rows[0]["index"], rows[-1]["index"]
        raise ValueError(f"rows {first}-{last}: a carried input column mixes types ({e})") from None


def _as_json(config: dict[str, Any]) -> dict[str, Any]:
    """config as its manifest holds it (tuples as lists, ...), so that both compare equal."""
    return json.loads(json.dumps(config, default=str))


def _differences(recorded: dict[str, Any], config: dict[str, Any], keys: set[str], where: str, here: str) -> list[str]:
    """'key: value where, value here' for each of keys whose value differs between a recorded config
    and this one, less what a run may change (its shard count, its input files' sizes) and the model's
    names while its fingerprint is the same; each key mentioned (an OptionError names it as its
    caller does: --target on the command line for the record's task)."""
    return [f"{mention(k)}: {recorded.get(k)!r} {where}, {config.get(k)!r} {here}"
            for k in sorted(keys - {_SHARDS, *_INPUT_SIZES}) if recorded.get(k) != config.get(k)
            and (k not in _RECORDED or _other_model(recorded, config))]


def _match(recorded: Any, now: Any) -> str:
    """How to continue a run under the numerics it recorded (what its rows' last bits depend on)."""
    recorded, now = recorded if isinstance(recorded, dict) else {}, now if isinstance(now, dict) else {}
    ways = []
    for key in sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k)):
        value = recorded.get(key)
        if key == "threads":
            ways.append(f"its parts were computed with {value} thread{'s' * (value != 1)} (torchrun sets "
                        f"OMP_NUM_THREADS=1): run with OMP_NUM_THREADS={value}")
        elif key == "batch_tokens":
            ways.append(f"its parts were cut into batches of at most {value} tokens: pass "
                        f"{mention('batch_tokens')} {value}")
        else:
            ways.append(f"it ran with {key} {value!r}: run with the same")
    return "; ".join(ways) + " to continue it"


def _other_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records may name other models: their fingerprints differ, or one is not known."""
    return a.get("model_fingerprint") is None or a.get("model_fingerprint") != b.get("model_fingerprint")


def _parts(problems: list[str]) -> str:
    return "1 part is" if len(problems) == 1 else f"{len(problems)} parts are"



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
            self._schema, self._described = part, {k: v for k, v in described.items() if k != PART}
        else:
            self._schema = pa.unify_schemas([self._schema, part], promote_options="permissive")
        for stage, names in described.get("paths", {}).items():
            self._paths.setdefault(stage, set()).update(names)

    def merged(self) -> pa.Schema:
        merged = dict(self._described)
        if self._paths:
            merged["paths"] = {stage: sorted(names) for stage, names in sorted(self._paths.items())}
        return self._schema.with_metadata({METADATA_KEY: json.dumps(merged).encode()})


def conformed(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table with the merged schema's columns, in its order; columns it lacks are null."""
    if table.schema.equals(schema, check_metadata=False):  # as every part of one run's is
        return table.replace_schema_metadata(schema.metadata)
    held = dict(zip(table.column_names, table.columns, strict=True))  # by name: table[name] looks through them all
    columns = [held[f.name].cast(f.type) if f.name in held else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.table(columns, schema=schema)


def _error_lines(table: pa.Table) -> Iterator[str]:
    if "error" not in table.column_names:
        return
    for index, status, error in zip(*(table[c].to_pylist() for c in ("index", "status", "error")), strict=True):
        if status == INPUT_ERROR:
            yield json.dumps({"index": index, "error": error}) + "\n"
