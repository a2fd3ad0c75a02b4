"""A run folder's life: checked against the run before anything slow loads (check), taken and started or
continued (start), its chunks' parts written (write_part, write_partial), merged (merge), or left as found
where the run failed before its first part (abandon). What each step decides is in the modules beside
this one: config_match (is it this run?), damage (is this part this run's?), parts (a chunk's rows),
merge (the parts into the output)."""

from __future__ import annotations

import json
import logging
import math
import re
from contextlib import suppress
from pathlib import Path
from typing import Any

import pyarrow as pa

from gradspec.files import atomic_write, create_new, read_text
from gradspec.files.locks import Shard
from gradspec.files.parts import PartsFolder, part_numbers
from gradspec.options import OptionError, OptionExists, mention
from gradspec.runs.run_folder.config_match import as_json, out_differences, recorded_config, refuse_other_config
from gradspec.runs.run_folder.damage import move_aside, part_problem
from gradspec.runs.run_folder.fingerprints import FINGERPRINT, INPUT_SIZES, SHARDS, config_fingerprint, run_config
from gradspec.runs.run_folder.merge import mergeable, remove_output_temporaries, write_merged
from gradspec.runs.run_folder.parts import partial_path, read_partial, rows_table, write_part, write_partial

log = logging.getLogger("gradspec")

_MANIFEST = "manifest.json"
_INPUT_END = "input_end.json"  # {"rows": n}: the input (a stream shorter than the limit) held n rows


class RunFolder(PartsFolder):
    """``<out>.parts/``: manifest.json (the run's config), NNNNNNNN.parquet (one per chunk) and the
    lock files of the processes working in it."""

    OURS = re.compile(r"\d{8,}\.(partial\.)?parquet(\.sha256)?|manifest\.json|input_end\.json")
    CLEARED_LAST = ("manifest.json",)  # until it goes, tidy_merged recognises what is left as the merged run's

    def __init__(self, out: str | Path) -> None:
        super().__init__(out)
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

    def _run_fingerprint(self) -> str:
        """The run's config fingerprint (from its manifest, once), which every part it writes records."""
        if self._fingerprint is None:
            self._fingerprint = config_fingerprint(self.manifest() or {})
        return self._fingerprint

    def partial(self, chunk: int) -> Path:
        """The rows of a chunk not finished yet, written every --flush-minutes (removed with its part)."""
        return partial_path(self.part(chunk))

    def write_partial(self, chunk: int, rows: list[dict[str, Any]]) -> None:
        """The rows of an unfinished chunk scored so far (parts.write_partial)."""
        write_partial(self.partial(chunk), chunk, rows, self._run_fingerprint())

    def partial_rows(self, chunk: int) -> list[dict[str, Any]]:
        """The rows a killed run scored of a chunk before it could finish it (parts.read_partial)."""
        return read_partial(self.partial(chunk), chunk, self._run_fingerprint(), self.damaged_path)

    def write_part(self, chunk: int, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
        """A chunk's rows, with the run's config fingerprint and the rows it holds in its metadata."""
        self.write_table(chunk, rows_table(rows), metadata)

    def write_table(self, chunk: int, table: pa.Table, metadata: dict[str, Any]) -> None:
        """write_part of rows already made a table (its index column: the chunk's rows, in order)."""
        write_part(self.part(chunk), chunk, table, metadata, self._run_fingerprint())

    def done(self) -> set[int]:
        return set(part_numbers(self.path))

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
            differences = out_differences(self.out, config, unknown) if resume else []
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
            if not resume and old.get(SHARDS, shards) != shards:  # a split the run's other shards do not share
                raise OptionExists((), f"{self.path} holds a run split into {old[SHARDS]} shards, and "
                                   f"this is one of {shards}: pass {mention('shard')} i/{old[SHARDS]} as its other "
                                   f"shards did, or {mention('resume')} to finish its chunks with any split")
            refuse_other_config(self.path, old, config, unknown)
        if not member and not unknown:
            self._vet(config)

    def complete(self, config: dict[str, Any], unknown: tuple[str, ...] = ()) -> bool:
        """Whether out is already this run's merged file (a --resume of it has nothing left to do):
        its recorded config is this one (less the keys unknown yet). What a merge stopped after its
        file was in place left behind is removed (tidy_merged)."""
        if not self.out.is_file() or out_differences(self.out, config, unknown):
            return False
        self.tidy_merged()
        return True

    def tidy_merged(self) -> bool:
        """Removes what a merge killed after its file was in place left behind (the parts it merged,
        their checksums, the manifest; nothing else), so that the run reads as finished; returns
        whether there was any. Only where out's recorded fingerprint is the manifest's."""
        if not self.out.is_file() or not self.path.is_dir() or self.path.is_symlink():
            return False
        manifest, merged = self.manifest(damaged_ok=True), recorded_config(self.out)
        if manifest is None or isinstance(merged, str) or \
                merged.get(FINGERPRINT) != config_fingerprint(run_config(manifest)):
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
            remove_output_temporaries(self.out, self.errors_path)
        self.check(config, resume, False, shards, shard, member=True)  # the lock is checked above
        if not member:
            self._vet(config, records, shard)  # before a manifest is written: a refused run leaves none
        config = as_json(config)
        self._fingerprint = config_fingerprint(config)
        old = self.manifest(damaged_ok=resume)
        if old is not None:  # continued: check() refused any other config, here what may change is said, once
            for k in INPUT_SIZES:
                if old.get(k) != config.get(k):
                    log.warning("%s: %s was %s bytes when the run started, %s now; the parts already written are "
                                "kept (a fixed row, say), the rest is scored from the file as it is now", self.path,
                                k, old.get(k), config.get(k))
            return False
        self.path.mkdir(parents=True, exist_ok=True)
        if resume:
            (self.path / _MANIFEST).unlink(missing_ok=True)  # a damaged one (manifest): written again
        if create_new(self.path / _MANIFEST, json.dumps({**config, SHARDS: shards}, indent=1)):
            return True
        refuse_other_config(self.path, self.manifest(), config)  # another shard wrote it first
        return False

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
        config, records = as_json(config), self._rows(records)
        fingerprint, chunk_rows = config_fingerprint(config), config.get("chunk_rows")
        chunks = None if records is None or chunk_rows is None else math.ceil(records / chunk_rows)
        problems = []
        for chunk in sorted(self.done()):
            why = part_problem(self.part(chunk), chunk, fingerprint, config, records, chunk_rows,
                               verify=shard is not None and shard.owns(chunk))
            if why is None:
                continue
            if why.startswith("damaged"):
                if shard is not None and shard.owns(chunk) and chunks is not None and chunk < chunks:
                    aside = move_aside(self.part(chunk), self.damaged_path)
                    if aside is not None:
                        log.warning("%s: %s; moved to %s, its chunk is scored again", self.part(chunk), why, aside)
                continue  # another shard's, or found before the run starts: its owner moves it
            problems.append(f"{self.part(chunk).name}: {why}")
        if problems:
            many = "1 part is" if len(problems) == 1 else f"{len(problems)} parts are"
            raise OptionError((), f"cannot continue the run in {self.path}: {many} not of this run: "
                              + "; ".join(problems) + "; move them out of the folder (their chunks are then scored "
                              f"again) or pass {mention('overwrite')} to start again")

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
            remove_output_temporaries(self.out, self.errors_path)
            parts, schema = mergeable(self.path, self.done(), self.part, self.manifest, self._rows(records),
                                      chunk_rows, progress)
            rows = write_merged(self.out, self.errors_path, parts, schema, chunk_rows, progress)
            self.clear()  # the parts merged, their checksums, the manifest, killed writes' temporaries
        finally:
            self.release()  # the run is over (or refused): its lock goes, and the folder if it is empty
        if self.path.exists():
            left = sorted(p.name for p in self.path.iterdir())
            log.warning("kept %s: it holds files merge did not write (%s)", self.path, ", ".join(left[:10]))
        return rows

    def abandon(self) -> None:
        """After a failure before any part was written: removes what this process started in the
        folder (and the folder, if that leaves it empty), so the corrected command starts afresh;
        kept if it holds a part or another process's lock. A user's own files there stay."""
        own = None if self._lock is None else self._lock.path
        if self.done() or any(self.path.glob("*.partial.parquet")) or any(p != own for p in self.lock_files()):
            return
        self.clear()
        self.release()
