"""gradspec.files: what is not a regular file is refused before it is opened (a FIFO would block the
reader past any signal), checksums name what changed, temporaries are recognised by one matcher, a
name taken only if absent is taken once, and a folder is written aside and put in place whole."""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from gradspec.errors import InputError
from gradspec.files import (
    NotRegularFile,
    checksum_problem,
    create_new,
    is_temporary,
    open_regular,
    read_bytes,
    regular,
    sha256,
    temporary,
    temporary_of,
    write_checksum,
    write_checksummed,
    write_folder,
)


def _special(tmp_path, kind):
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    return path


@pytest.mark.parametrize("kind,named", [("fifo", "a FIFO"), ("folder", "a folder"), ("socket", "a socket")])
def test_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind, named):
    path = _special(tmp_path, kind)
    done = []

    def read_it():
        for read in (open_regular, read_bytes, regular, sha256):
            with pytest.raises(NotRegularFile) as refused:
                read(path)
            done.append(str(refused.value))

    reader = threading.Thread(target=read_it, daemon=True)
    reader.start()
    reader.join(timeout=30)  # a blocking open would still be waiting for a writer
    assert not reader.is_alive(), "a read blocked"
    assert len(done) == 4 and all(d.startswith(f"{path}: {named}") for d in done)
    assert issubclass(NotRegularFile, InputError) and issubclass(NotRegularFile, OSError)


def test_a_link_to_a_regular_file_reads_and_a_missing_file_is_file_not_found(tmp_path):
    target = tmp_path / "t.txt"
    target.write_bytes(b"abc")
    (tmp_path / "link").symlink_to(target)
    assert read_bytes(tmp_path / "link") == b"abc"
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")


def test_a_checksum_names_a_changed_byte_a_missing_checksum_and_a_fifo(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"x" * 5000)
    write_checksum(path)
    assert checksum_problem(path) is None
    path.write_bytes(b"x" * 4999 + b"y")
    assert checksum_problem(path) == "damaged, its bytes differ from those written (checksum mismatch)"
    (tmp_path / "p.parquet.sha256").unlink()
    assert checksum_problem(path).startswith("damaged, no checksum beside it")
    write_checksum(path)
    path.unlink()
    os.mkfifo(path)
    assert checksum_problem(path).startswith("damaged, a FIFO")


def test_temporaries_are_matched_by_their_name_and_pid_alone(tmp_path):
    part = re.compile(r"\d{8}\.parquet")
    assert temporary(tmp_path / "a.parquet").name == f"a.parquet.tmp{os.getpid()}"
    assert is_temporary("00000001.parquet.tmp42", part) and is_temporary("out.parquet.tmp7", "out.parquet")
    assert not is_temporary("00000001.parquet.tmp", part) and not is_temporary("notes.parquet.tmp1", part)
    assert not is_temporary("out.parquet.tmp7x", "out.parquet") and not is_temporary("xout.parquet.tmp7", "out.parquet")


def test_a_name_taken_only_if_absent_is_taken_once_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "manifest.json"
    assert create_new(path, "one") and not create_new(path, "two")
    assert path.read_text() == "one" and sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("stopped_at", [2, 3], ids=["before the file's rename", "before the checksum's last write"])
def test_a_file_replaced_with_its_checksum_is_accepted_wherever_the_replacement_stops(tmp_path, monkeypatch,
                                                                                      stopped_at):
    """The checksum accepts the old bytes and the new while the file is replaced: a partial part rewritten every
    --flush-minutes, stopped between its two writes, was set aside as damaged."""
    from gradspec.files import primitives

    path = tmp_path / "p.parquet"
    write_checksummed(path, lambda f: f.write(b"old"))
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == stopped_at:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(primitives.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write_checksummed(path, lambda f: f.write(b"new"))
    monkeypatch.undo()
    assert path.read_bytes() == (b"old" if stopped_at == 2 else b"new") and checksum_problem(path) is None
    path.write_bytes(b"neither")
    assert checksum_problem(path) == "damaged, its bytes differ from those written (checksum mismatch)"
    write_checksummed(path, lambda f: f.write(b"new"))
    assert (tmp_path / "p.parquet.sha256").read_text() == sha256(path)  # one digest once it is in place


def test_a_folder_is_written_aside_whole_or_not_at_all(tmp_path):
    """write_folder: what the write made is at the path once it returned, nothing of a write that failed
    is, and no temporary is left either way; an earlier folder is replaced, or with keep_first kept."""
    target = tmp_path / "model"

    def write(text):
        return lambda folder: (folder.mkdir(), (folder / "config.json").write_text(text))

    assert write_folder(target, write("one")) and (target / "config.json").read_text() == "one"
    assert write_folder(target, write("two")) and (target / "config.json").read_text() == "two"
    assert not write_folder(target, write("three"), keep_first=True) and (target / "config.json").read_text() == "two"

    def fails(folder):
        write("half")(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_folder(tmp_path / "other", fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert temporary_of(temporary(target).name) == "model" and temporary(target, 42).name == "model.tmp42"


CONVERTS = """
import sys, time
from pathlib import Path
from gradspec.files import write_folder
target, ready, go = map(Path, sys.argv[1:4])
def write(folder):
    folder.mkdir()
    (folder / "writer").write_text(sys.argv[4])
    ready.with_name(ready.name + sys.argv[4]).touch()
    while not go.exists():
        time.sleep(0.02)
    (folder / "config.json").write_text(sys.argv[4])
print(write_folder(target, write, keep_first=True))
"""


def test_two_processes_writing_one_folder_at_once_write_apart_and_the_first_is_kept(tmp_path):
    """Two processes converting the default model at once: each writes its own temporary folder (a fixed
    name had both write into one), one of them is put in place whole, the other's removed."""
    target, ready, go = tmp_path / "model", tmp_path / "ready", tmp_path / "go"
    writers = [subprocess.Popen([sys.executable, "-c", CONVERTS, str(target), str(ready), str(go), name],
                                stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    for name, writer in zip("ab", writers, strict=True):
        while not (tmp_path / f"ready{name}").exists():
            assert writer.poll() is None, writer.communicate()
            time.sleep(0.02)
    go.touch()
    placed = [writer.communicate(timeout=120)[0].strip() for writer in writers]
    assert sorted(placed) == ["False", "True"]
    first = "ab"[placed.index("True")]
    assert (target / "writer").read_text() == (target / "config.json").read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "model", "readya", "readyb"]
