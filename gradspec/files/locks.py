"""The lock files of a folder gradspec writes and deletes in (a scoring run's parts, a monitor's parts),
and the rules that protect such a folder: no symbolic link is followed to it, one writer per share of
its chunks, and only gradspec's own files are ever deleted in it.

Each process holds a lock file for the chunks it writes: run.lock for the whole folder (one process,
torchrun's rank 0 for all its ranks, a merge, a monitor), shard-I-of-N.lock for --shard I/N. A lock
refuses any other process whose chunks overlap its own (shards i/N and j/M overlap when
i = j mod gcd(N, M); the whole folder overlaps every shard) while its owner lives; the lock of a process
that is gone (its pid no longer running on its host, or, seen from another host, not refreshed for
LOCK_STALE_S) is taken over with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradspec.files.primitives import create_new, is_temporary, read_text
from gradspec.options import OptionError, mention

log = logging.getLogger("gradspec")

LOCK_BEAT_S = 30.0  # a lock's owner refreshes its file's time this often
LOCK_STALE_S = 600.0  # a lock on another host not refreshed for this long: its owner is gone
_WHOLE = "run.lock"
_SHARD_LOCK = re.compile(r"shard-(\d+)-of-(\d+)\.lock")
_ANY_LOCK = re.compile(r".+\.lock")  # what a lock's temporary (a write cut short) is of
_STALE = re.compile(r".+\.lock\.stale\d+")  # a gone owner's lock set aside by a takeover cut short


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

    def overlaps(self, other: Shard) -> bool:
        """Whether some chunk belongs to both."""
        return (self.index - other.index) % math.gcd(self.count, other.count) == 0


class RunLocked(FileExistsError):
    """A live process owns the chunks this one would score, merge or remove."""


@dataclass
class _Lock:
    path: Path
    text: str
    stop: threading.Event = field(default_factory=threading.Event)


class LockedFolder:
    """A folder gradspec writes and deletes in, guarded as one: its lock files, no link followed to it,
    and only the files its writer makes (names OURS matches, their temporaries, locks of processes that
    are gone) deleted by clear."""

    OURS: re.Pattern[str] = re.compile(r"(?!)")  # the names of the files this folder's writer makes
    CLEARED_LAST: tuple[str, ...] = ()  # names clear deletes after all others

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock: _Lock | None = None

    def ours(self, name: str) -> bool:
        """Whether a file of the folder is one its writer makes (or a killed write's temporary of one)."""
        return bool(self.OURS.fullmatch(name) or is_temporary(name, self.OURS) or is_temporary(name, _ANY_LOCK)
                    or _STALE.fullmatch(name))

    def guarded(self) -> tuple[Path, ...]:
        """The folders that must not be links: gradspec deletes in them."""
        return (self.path,)

    def acquire(self, shard: Shard = Shard(), whole: bool = False) -> None:
        """Takes this process's lock file for shard's chunks (whole: checked against every other lock,
        as for an overwrite or a merge, which touch all chunks). Raises RunLocked while a live process
        holds an overlapping lock; an overlapping lock whose owner is gone is taken over, with a warning."""
        if self._lock is not None:
            return
        self.refuse_links()
        path = self.path / (_WHOLE if shard.count == 1 else f"shard-{shard.index}-of-{shard.count}.lock")
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), **_machine(),
                           "started": _process_start(os.getpid()), "shard": f"{shard.index}/{shard.count}",
                           "token": uuid.uuid4().hex})
        for _ in range(10):
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                if create_new(path, text):
                    break
            except FileNotFoundError:  # the folder was removed meanwhile: make it again
                continue
            self._remove_stale(path)
        else:
            raise RunLocked(f"{path}: could not take this lock (other processes keep taking it)")
        self._lock = _Lock(path, text)
        threading.Thread(target=_beat, args=(self._lock,), name="gradspec-lock", daemon=True).start()
        try:
            scope = Shard() if whole else shard
            for other in self.lock_files():
                theirs = _lock_shard(other)
                if other != path and theirs is not None and theirs.overlaps(scope):
                    self._remove_stale(other)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Gives up this process's lock (and removes the folder if nothing else is left in it)."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        lock.stop.set()
        if _read(lock.path) == lock.text:  # still ours
            lock.path.unlink(missing_ok=True)
        with suppress(OSError):
            self.path.rmdir()

    def lock_files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        return sorted(p for p in self.path.glob("*.lock") if _lock_shard(p) is not None)

    def refuse_live_owner(self, scope: Shard) -> None:
        own = None if self._lock is None else self._lock.path
        for path in self.lock_files():
            text, theirs = _read(path), _lock_shard(path)
            if path != own and text is not None and theirs is not None and theirs.overlaps(scope) and \
                    _alive(text, path):
                raise RunLocked(self._live_message(text, path))

    def _remove_stale(self, path: Path) -> None:
        """Removes the lock at path if its owner is gone, with a warning; raises RunLocked if it lives."""
        text = _read(path)
        if text is None:
            return  # released meanwhile
        if _alive(text, path):
            raise RunLocked(self._live_message(text, path))
        aside = path.with_name(f"{path.name}.stale{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != text:  # another process took it over between the read and the rename: put it back
            with suppress(OSError):
                os.link(aside, path)
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        owner = _record(text)
        log.warning("took over %s: its lock %s was left by pid %s on host %s, which is no longer running", self.path,
                    path.name, owner.get("pid"), owner.get("host"))

    def _live_message(self, text: str, path: Path) -> str:
        owner = _record(text)
        which = "the whole run" if path.name == _WHOLE else f"shard {owner.get('shard', '?')}"
        elsewhere = not _pid_here(owner)
        hint = (f"; if no such process runs on {owner.get('host')}, delete {path} (a lock not refreshed for "
                f"{LOCK_STALE_S:.0f} s is taken over by itself)") if elsewhere else ""
        if not elsewhere and owner.get("pid") == os.getpid():  # a monitor or run of this process, not closed
            return (f"this process (pid {os.getpid()}, {which}) already writes in {self.path}: close the monitor or "
                    "run writing there first, or give another path")
        return (f"a live run (pid {owner.get('pid')} on host {owner.get('host')}, {which}) owns {self.path}: wait "
                f"for it to finish or stop it, then run again{hint}")

    def clear(self) -> None:
        """What gradspec wrote in the folder (the names OURS matches, temporaries, the locks of processes
        that are gone; CLEARED_LAST last), but this process's lock: a user's own files there are kept."""
        own = None if self._lock is None else self._lock.path
        entries = list(self.path.iterdir()) if self.path.is_dir() and not self.path.is_symlink() else []
        for p in sorted(entries, key=lambda p: p.name in self.CLEARED_LAST):
            lock = _lock_shard(p) is not None
            if p == own or (lock and (text := _read(p)) is not None and _alive(text, p)):
                continue
            if (lock or self.ours(p.name)) and not p.is_dir():
                p.unlink(missing_ok=True)

    def refuse_links(self) -> None:
        """The guarded folders are real folders: gradspec deletes in them, and a link would lead it into
        someone else's."""
        for path in self.guarded():
            if path.is_symlink():
                raise OptionError((), f"{path}: a symbolic link; gradspec writes and deletes in its run folders and "
                                  "follows no link to them: remove the link (what it points to is left as it is) "
                                  f"or choose another {mention('out')}")


def _read(path: Path) -> str | None:
    try:
        return read_text(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError):
        return ""


def _record(text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _lock_shard(path: Path) -> Shard | None:
    """The chunks a lock file's name claims (None: not a lock file)."""
    if path.name == _WHOLE:
        return Shard()
    found = _SHARD_LOCK.fullmatch(path.name)
    if found is None or not 0 <= int(found[1]) < int(found[2]):
        return None
    return Shard(int(found[1]), int(found[2]))


def _process_start(pid: int) -> str | None:
    """When a process started (Linux: clock ticks since boot), to tell it from a later one with its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _machine() -> dict[str, str]:
    """What tells this host's pids from others' beyond its name: its boot and its pid namespace (a
    container's pids are its own)."""
    found = {}
    with suppress(OSError):
        found["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with suppress(OSError):
        found["pid_namespace"] = os.readlink("/proc/self/ns/pid")
    return found


def _pid_here(owner: dict[str, Any]) -> bool:
    """Whether a lock's owner's pid is one of this host's (its name, boot and pid namespace; a record
    without the last two: its name alone)."""
    return owner.get("host") == socket.gethostname() and \
        all(owner[k] == v for k, v in _machine().items() if k in owner)


def _alive(text: str, path: Path) -> bool:
    """Whether a lock's owner still runs: on this host (its name, boot and pid namespace), by its pid
    and start time; elsewhere (another host, container or boot), by whether its file was refreshed in
    the last LOCK_STALE_S."""
    owner = _record(text)
    pid = owner.get("pid")
    if _pid_here(owner) and isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: alive
            pass
        except OSError:
            return False
        started = owner.get("started")
        now = _process_start(pid)
        return started is None or now is None or now == started
    try:
        return time.time() - path.stat().st_mtime < LOCK_STALE_S
    except FileNotFoundError:
        return False


def _beat(lock: _Lock) -> None:
    """Refreshes a held lock's time, so that other hosts see its owner alive."""
    while not lock.stop.wait(LOCK_BEAT_S):
        try:
            os.utime(lock.path)
        except OSError:
            return
