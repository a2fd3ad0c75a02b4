"""What gradspec does to the disk, once: every file it reads is opened as a regular file or refused
before anything blocks (a FIFO, a device or a socket where a file should be would hang the command);
every file it writes is written aside and renamed (a kill leaves the old file or the whole new one);
checksums are streamed; a name written "only if absent" is taken by a hard link, atomically.

Temporaries, of files and folders alike, are named ``<name>.tmp<pid>`` (``temporary``), and
``temporary_of``/``is_temporary`` are their one matcher: what a killed write leaves is recognised the same
way wherever it is listed or tidied up.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from gradspec.errors import InputError

CHECKSUM = ".sha256"  # beside a checksummed file (<name>.sha256): the SHA-256 of its bytes, in hex
_TEMPORARY = re.compile(r"(.+)\.tmp\d+")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # none on Windows, which has no FIFO to block on
_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link"}


class NotRegularFile(InputError, OSError):
    """A path that should be a file is a FIFO, a device, a socket or a folder: refused before it is opened
    (reading a FIFO blocks until someone writes to it, past any signal)."""


def refusal(path: str | Path, mode: int, what: str = "") -> NotRegularFile:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return NotRegularFile(f"{path}: {kind}, not a regular file{'; ' + what if what else ''}")


def regular(path: str | Path, what: str = "") -> Path:
    """path, checked to be a regular file (through links) for a library that opens it by name itself:
    NotRegularFile (naming what was expected, what) where it is something else. A missing file raises
    FileNotFoundError, as open would."""
    path = Path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise refusal(path, mode, what)
    return path


def open_regular(path: str | Path, what: str = "") -> IO[bytes]:
    """path opened for reading in binary, or NotRegularFile where it is not a regular file: it is opened
    without blocking and checked on the open descriptor, so nothing swapped in between is read."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        if e.errno != errno.ENXIO:  # what opening a socket (or a device without its driver) says
            raise
        raise refusal(path, os.stat(path).st_mode, what) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise refusal(path, mode, what)
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, what: str = "") -> bytes:
    with open_regular(path, what) as f:
        return f.read()


def read_text(path: str | Path, what: str = "", encoding: str = "utf-8") -> str:
    return read_bytes(path, what).decode(encoding)


def load_torch(path: str | Path, what: str = "") -> Any:
    """What torch.save wrote to path, loaded without running code from it (torch's weights_only:
    tensors, containers and plain values; a caller widens it with torch.serialization.safe_globals),
    on the CPU. InputError naming path where the bytes do not load so: a pickle that would run code,
    garbled or cut-short bytes."""
    import torch

    regular(path, what)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about a pickle's protocol over several lines
        try:  # mapped, not read: an optimizer's state can be tens of GB, and only its shapes may be needed
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=_zipped(path))
        except Exception as e:  # whatever torch's unpickler or zip reader meets in the bytes
            raise InputError(f"{path}: not loadable safely ({load_failure(e)})") from e


def _zipped(path: str | Path) -> bool:
    """Whether a torch file is of the zip format (torch.save's since 1.6), the one torch.load can map."""
    with open_regular(path) as f:
        return f.read(4) == b"PK\x03\x04"


def load_failure(error: Exception) -> str:
    """Why torch.load (or a library reading a file) refused it, in a few words on one line: torch wraps an
    unpickler's refusal in advice over several lines, the refusal itself is the error it wrapped."""
    if isinstance(error, EOFError):
        return "empty or cut short"
    if isinstance(error.__context__, pickle.UnpicklingError):
        error = error.__context__
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    reason = line.split(". ")[0].rstrip(".")[:200]
    return reason if reason and not isinstance(error, LookupError) else f"{type(error).__name__} {reason}".strip()


def sha256(path: str | Path) -> str:
    """The SHA-256 of a regular file's bytes, in hex, read a block at a time (never whole into memory)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksum_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM)


def write_checksum(path: str | Path) -> None:
    """path's SHA-256 beside it (<name>.sha256), written after it: a file without one is a write cut short."""
    digest = sha256(path)
    atomic_write(checksum_path(path), lambda f: f.write(digest.encode()))


def write_checksummed(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """atomic_write with the file's SHA-256 beside it, never out of step with it: the checksum is written
    before the rename, accepting the bytes being replaced and the new ones until the new ones are in place,
    then the new ones alone. A kill at any moment leaves a file its checksum accepts."""
    path, check = Path(path), checksum_path(path)

    def both(tmp: Path) -> None:
        kept = read_text(check).split() if path.exists() and check.exists() else []
        digest = sha256(tmp)
        atomic_write(check, lambda f: f.write("\n".join([*kept, digest]).encode()))
        written.append(digest)

    written: list[str] = []
    atomic_write(path, write, before=both)
    atomic_write(check, lambda f: f.write(written[0].encode()))


def checksum_problem(path: str | Path, data: bytes | None = None) -> str | None:
    """Why path's bytes are not those written (\"damaged, ...\"), or None. FileNotFoundError where path
    itself is gone. data: path's bytes, already read (checked as read, not read again: what is checked is what
    the caller parses)."""
    try:
        expected = read_text(checksum_path(path)).strip()
    except FileNotFoundError:
        return "damaged, no checksum beside it (its write was stopped, or an earlier gradspec wrote it)"
    except (OSError, UnicodeDecodeError) as e:
        return f"damaged, its checksum cannot be read ({e})"
    try:
        actual = sha256(path) if data is None else hashlib.sha256(data).hexdigest()
    except NotRegularFile as e:
        return f"damaged, {str(e).partition(': ')[2]}"
    if actual not in expected.split():  # one digest, or two while write_checksummed replaces the file
        return "damaged, its bytes differ from those written (checksum mismatch)"
    return None


def temporary(path: str | Path, pid: int | None = None) -> Path:
    """Where a process writes path before renaming it into place: <name>.tmp<pid> (pid: this process's;
    another where several processes write one folder and one of them renames it)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid() if pid is None else pid}")


def temporary_of(name: str) -> str | None:
    """The name a temporary of ``temporary``'s is written for (None: name is no temporary)."""
    found = _TEMPORARY.fullmatch(name)
    return None if found is None else found[1]


def is_temporary(name: str, of: re.Pattern[str] | str | None = None) -> bool:
    """Whether a file name is a temporary of ``temporary``'s (of a name that ``of`` matches in full, or
    equals; None: of any name)."""
    target = temporary_of(name)
    if target is None or of is None:
        return target is not None
    return of.fullmatch(target) is not None if isinstance(of, re.Pattern) else target == of


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None],
                 before: Callable[[Path], None] | None = None) -> None:
    """write(file) into a temporary file beside path, flushed to disk, then renamed onto path: the
    file at path is either the old one or the whole new one, never part of it. before: called with the
    temporary, whole on disk, just before the rename."""
    path = Path(path)
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before is not None:
            before(tmp)
        os.replace(tmp, path)
    except OSError as e:  # a full disk says only "[Errno 28] No space left on device": name the file
        tmp.unlink(missing_ok=True)
        if e.filename is not None:
            raise
        if e.errno:
            raise OSError(e.errno, f"{os.strerror(e.errno)} (writing it)", str(path)) from e
        raise OSError(f"{path}: {' '.join(str(e).split())} (writing it)") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_new(path: str | Path, data: str | bytes) -> bool:
    """data written to path only if nothing is there (written aside, then hard-linked: atomic, and never
    half a file); returns whether this call created it."""
    path = Path(path)
    tmp = temporary(path)
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def write_folder(path: str | Path, write: Callable[[Path], None], keep_first: bool = False) -> bool:
    """write(folder) into a temporary folder beside path, then put in place (place_folder): path is
    never half written, and two processes writing it at once write apart. A failed write leaves no
    temporary. Returns whether this call's folder is at path (keep_first: see place_folder)."""
    tmp = temporary(path)
    try:
        write(tmp)
        return place_folder(tmp, path, keep_first)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def place_folder(tmp: str | Path, path: str | Path, keep_first: bool = False) -> bool:
    """A folder written whole at tmp renamed onto path; returns whether it is there now. An earlier
    folder at path (not a link) is replaced, or with keep_first kept, tmp left for the caller to remove
    (another process wrote the same folder first)."""
    tmp, path = Path(tmp), Path(path)
    if keep_first:
        try:
            os.rename(tmp, path)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and path.is_dir():
                return False
            raise
        return True
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return True


@contextmanager
def parquet_errors(path: str | Path, what: str = "") -> Iterator[None]:
    """pyarrow's errors while the Parquet file at path is read (a truncated or damaged file: they name no
    file, and some span lines) as one InputError line naming it and what to pass (what); the disk's own
    errors (with an errno) and gradspec's pass as they are."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, InputError) or getattr(e, "errno", None) is not None:
            raise
        raise InputError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())})"
                         f"{'; ' + what if what else ''}") from None
