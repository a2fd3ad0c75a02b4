"""The run folder keeps a run whole: parts of another config or of other rows are refused by
--resume and merge (named, with what differs), merge deletes only what it merged, a damaged part
is named and scored again on --resume, and a lock keeps a second process off the chunks of a
live one (per shard: the shards of a split share the folder).

Every run is a real `gradspec score` (in this process, or in a subprocess where a run must be
alive or die meanwhile); rows are compared with an uninterrupted run, table for table.
"""

import errno
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_model

import gradspec
from gradspec.cli import main
from gradspec.runs import run_folder
from gradspec.runs.run_folder import merge as run_merge

ROWS = 24  # input rows
CHUNK = "4"  # rows per part: 6 parts
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
LAUNCH = "import sys; {patch}\nfrom gradspec.cli import main; sys.exit(main(sys.argv[1:]))"
# A run that stops before it writes chunk 2 until the file GO exists, having made READY.
WAIT_AT_CHUNK_2 = ("import os, time, gradspec.runs.run_folder as rf; real = rf.RunFolder.write_part\n"
                   "def write_part(self, chunk, rows, metadata):\n"
                   "    if chunk == 2:\n"
                   "        open({ready!r}, 'w').close()\n"
                   "        while not os.path.exists({go!r}): time.sleep(0.05)\n"
                   "    real(self, chunk, rows, metadata)\n"
                   "rf.RunFolder.write_part = write_part")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Runs in this process sum as the subprocesses do (ONE_THREAD), so their rows compare bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "d.jsonl"
    rows = [{"instruction": f"Question {i}: " + "why " * (i % 5), "output": "Because " + "so " * (1 + i % 7)}
            for i in range(ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(model, data, out, *extra):
    return ["score", "--model", str(model), "--data", str(data), "--out", str(out), "--chunk-rows", CHUNK,
            "--batch-tokens", "256", "--quiet", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, data):
    """The uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("reference") / "s.parquet"
    assert main(_args(tiny_model_dir, data, out)) == 0
    return pq.read_table(out)


def _same(path, reference):
    got = pq.read_table(path)
    assert got.column("index").to_pylist() == list(range(ROWS))
    assert got.equals(reference, check_metadata=True)


def _error(capsys):
    return capsys.readouterr().err.strip().removeprefix("gradspec: error: ")


def _files(folder, checksums=False):
    """The folder's files (without the parts' checksums unless asked)."""
    return sorted(p.name for p in folder.iterdir() if checksums or not p.name.endswith(".sha256"))


def _cli(args, patch=""):
    return subprocess.Popen([sys.executable, "-c", LAUNCH.format(patch=patch), *args], env=ONE_THREAD,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc):
    """Until proc makes path (it fails the test if proc ends first)."""
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def _held_before_chunk_2(tmp_path, args):
    """A run in a subprocess, held before it writes chunk 2 (WAIT_AT_CHUNK_2), its first two parts written."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = _cli(args, WAIT_AT_CHUNK_2.format(ready=str(ready), go=str(go)))
    _wait_for(ready, proc)
    return proc


def test_parts_copied_in_from_another_run_are_refused_by_merge_and_resume(tmp_path, tiny_model_dir, data, capsys):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--shard", "0/2")) == 0  # chunks 0, 2, 4
    other = tmp_path / "o.parquet"  # chunks 1, 3, 5 of another config
    assert main(_args(tiny_model_dir, data, other, "--shard", "1/2", "--max-length", "64")) == 0
    for part in (tmp_path / "o.parquet.parts").glob("*.parquet"):
        shutil.copy(part, parts / part.name)  # the folder now looks complete
    before = _files(parts)
    capsys.readouterr()
    assert main(["merge", "--out", str(out)]) == 2
    err = _error(capsys)
    assert err.startswith(f"cannot merge {parts}, nothing was written or deleted: 00000001.parquet: its config "
                          "differs: --max-length: 64 in the part, 2048 in the run; 00000003.parquet: ")
    assert not out.exists() and _files(parts) == before
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 2
    assert "00000005.parquet: its config differs: --max-length: 64 in the part, 2048 in the run" in _error(capsys)
    assert _files(parts) == before


def test_a_deleted_manifest_then_resume_with_another_config_is_refused(tmp_path, tiny_model_dir, data, capsys):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--shard", "0/2")) == 0
    (parts / "manifest.json").unlink()
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, out, "--resume", "--max-length", "64")) == 2
    err = _error(capsys)
    assert err.startswith(f"cannot continue the run in {parts}: 3 parts are not of this run: 00000000.parquet: "
                          "its config differs: --max-length: 2048 in the part, 64 in the run; ")
    assert _files(parts) == ["00000000.parquet", "00000002.parquet", "00000004.parquet"]  # no manifest written


def test_a_model_named_alike_in_another_folder_is_another_model(tmp_path, tiny_model_dir, data, capsys, monkeypatch):
    """--model tiny resumed from another working folder, where tiny is a model of the same layout and
    size with other weights: the run records the model's folder and a fingerprint of its files."""
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(tiny_model_dir, here / "tiny")
    shutil.copytree(tiny_model_dir, there / "tiny")
    tiny_model("llama", seed=1).save_pretrained(there / "tiny")  # same config, same file sizes, other weights
    out = tmp_path / "s.parquet"
    monkeypatch.chdir(here)
    assert main(_args("tiny", data, out, "--shard", "0/2")) == 0
    monkeypatch.chdir(there)
    capsys.readouterr()
    assert main(_args("tiny", data, out, "--resume")) == 2
    err = _error(capsys)
    assert err.startswith(f"cannot continue the run in {tmp_path / 's.parquet.parts'}, its config differs: "
                          "model_fingerprint: '")
    assert f"model_path: '{(here / 'tiny').resolve()}' in the run, '{(there / 'tiny').resolve()}' now" in err
    elsewhere = tmp_path / "elsewhere"  # the same files in a third folder: the same model
    shutil.copytree(here / "tiny", elsewhere / "tiny")
    monkeypatch.chdir(elsewhere)
    assert main(_args("tiny", data, out, "--shard", "1/2")) == 0
    assert main(["merge", "--out", str(out)]) == 0
    meta = json.loads(pq.read_schema(out).metadata[b"gradspec"])
    assert meta["model_path"] == str((here / "tiny").resolve()) and "part" not in meta
    assert len(meta["model_fingerprint"]) == len(meta["config_fingerprint"]) == 16


def test_merge_deletes_nothing_it_did_not_merge(tmp_path, tiny_model_dir, data, reference, capsys):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--no-merge")) == 0
    manifest = json.loads((parts / "manifest.json").read_text())
    shutil.copy(parts / "00000000.parquet", parts / "00000099.parquet")  # an unrelated part
    before = _files(parts)
    capsys.readouterr()
    assert main(["merge", "--out", str(out)]) == 2
    assert _error(capsys) == (f"cannot merge {parts}, nothing was written or deleted: 00000099.parquet: chunk 99, "
                              "but the run has 6 chunks (24 rows, 4 a chunk); move the parts named out of the "
                              "folder, then score their chunks again with --resume")
    assert not out.exists() and _files(parts) == before
    (parts / "00000099.parquet").unlink()
    for edit, said in (({"chunk_rows": 8}, "--chunk-rows: 4 in the part, 8 in the run"),
                       ({"limit": 12}, "--limit: None in the part, 12 in the run")):
        (parts / "manifest.json").write_text(json.dumps({**manifest, **edit}))  # a run's record edited
        assert main(["merge", "--out", str(out)]) == 2
        err = _error(capsys)
        assert err.startswith(f"cannot merge {parts}, nothing was written or deleted: 00000000.parquet: its config "
                              f"differs: {said}; 00000001.parquet: ")
        assert not out.exists() and _files(parts) == before[:-2] + ["manifest.json"]  # every part kept
    (parts / "manifest.json").write_text(json.dumps(manifest))
    (parts / "notes.txt").write_text("mine")
    assert main(["merge", "--out", str(out)]) == 0
    _same(out, reference)
    assert _files(parts) == ["notes.txt"]  # the parts and the manifest merged and gone, the rest kept


def test_a_damaged_part_is_named_and_scored_again_on_resume(tmp_path, tiny_model_dir, data, reference, capsys,
                                                             caplog):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--no-merge")) == 0
    whole = (parts / "00000001.parquet").read_bytes()
    (parts / "00000001.parquet").write_bytes(whole[: len(whole) // 2])  # truncated
    (parts / "00000002.parquet").write_bytes(b"\x07garbage" * 64)
    (parts / "00000003.parquet").write_bytes(b"")
    before = _files(parts)
    capsys.readouterr()
    assert main(["merge", "--out", str(out)]) == 2
    err = _error(capsys)
    assert err.startswith(f"cannot merge {parts}, nothing was written or deleted: 00000001.parquet: damaged, not "
                          "a readable Parquet file (")
    assert "; 00000002.parquet: damaged, " in err and "; 00000003.parquet: damaged, " in err
    assert err.endswith("score their chunks again with --resume (which moves a damaged part aside itself)")
    assert not out.exists() and _files(parts) == before
    caplog.set_level("WARNING", logger="gradspec")
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
    moved = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    damaged = tmp_path / "s.parquet.damaged"
    assert [m.split(":")[0] for m in moved] == [str(parts / f"0000000{c}.parquet") for c in (1, 2, 3)]
    assert moved[0].endswith(f"; moved to {damaged / '00000001.parquet'}, its chunk is scored again")
    assert _files(damaged) == ["00000001.parquet", "00000002.parquet", "00000003.parquet"]
    assert (damaged / "00000003.parquet").read_bytes() == b""
    _same(out, reference)
    assert not parts.exists()


def test_a_live_run_owns_its_chunks_and_shards_share_the_folder(tmp_path, tiny_model_dir, data, reference, capsys):
    """Shard 0/2 is alive (held before it writes chunk 2): a second 0/2, a whole run (--resume,
    --overwrite) and a merge are refused, naming it; shard 1/2 runs beside it."""
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = _cli(_args(tiny_model_dir, data, out, "--shard", "0/2"), WAIT_AT_CHUNK_2.format(ready=str(ready),
                                                                                           go=str(go)))
    try:
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        owner = f"a live run (pid {proc.pid} on host {socket.gethostname()}, shard 0/2) owns {parts}: wait for it " \
                "to finish or stop it, then run again"
        for extra in ([], ["--shard", "0/2"], ["--shard", "0/4"], ["--resume"], ["--overwrite"]):
            assert main(_args(tiny_model_dir, data, out, *extra)) == 2, extra
            assert _error(capsys) == owner, extra
        assert main(["merge", "--out", str(out)]) == 2
        assert _error(capsys) == owner
        assert _files(parts) == ["00000000.parquet", "manifest.json", "shard-0-of-2.lock"]
        assert main(_args(tiny_model_dir, data, out, "--shard", "1/2")) == 0  # the other shard: beside it
    finally:
        go.touch()
        printed, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert main(["merge", "--out", str(out)]) == 0
    _same(out, reference)
    assert not parts.exists()


def test_a_stale_lock_is_taken_over(tmp_path, tiny_model_dir, data, reference, capsys, caplog):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--shard", "0/2")) == 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid: no longer running
    (parts / "run.lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "shard": "0/1"}))
    elsewhere = parts / "shard-1-of-2.lock"  # a process on another host, its lock just refreshed
    elsewhere.write_text(json.dumps({"pid": 1, "host": "node-b", "shard": "1/2"}))
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 2
    assert _error(capsys) == (f"a live run (pid 1 on host node-b, shard 1/2) owns {parts}: wait for it to finish or "
                              "stop it, then run again; if no such process runs on node-b, delete "
                              f"{elsewhere} (a lock not refreshed for 600 s is taken over by itself)")
    old = time.time() - run_folder.LOCK_STALE_S - 60
    os.utime(elsewhere, (old, old))  # not refreshed: its owner is gone
    caplog.set_level("WARNING", logger="gradspec")
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("took over")]
    assert warned == [f"took over {parts}: its lock run.lock was left by pid {gone.pid} on host "
                      f"{socket.gethostname()}, which is no longer running",
                      f"took over {parts}: its lock shard-1-of-2.lock was left by pid 1 on host node-b, which is no "
                      "longer running"]
    _same(out, reference)
    assert not parts.exists()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_the_lock_is_released_however_a_run_ends(tmp_path, tiny_model_dir, data, monkeypatch, stop):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    real = run_folder.RunFolder.write_part

    def write_part(self, chunk, rows, metadata):
        assert [p.name for p in parts.glob("*.lock")] == ["run.lock"]  # held while it runs
        if chunk == 2:
            raise stop("stopped")
        real(self, chunk, rows, metadata)

    monkeypatch.setattr(run_folder.RunFolder, "write_part", write_part)
    assert main(_args(tiny_model_dir, data, out)) == (130 if stop is KeyboardInterrupt else 2)
    assert _files(parts, checksums=True) == ["00000000.parquet", "00000000.parquet.sha256", "00000001.parquet",
                                             "00000001.parquet.sha256", "manifest.json"]
    for thread in threading.enumerate():
        if thread.name == "gradspec-lock":
            thread.join(timeout=5)
            assert not thread.is_alive()


def test_torchrun_rank_0_alone_holds_the_lock(tmp_path, tiny_model_dir, data, reference):
    """Both ranks of a torchrun run score in one folder under rank 0's run.lock; a --shard process
    started meanwhile is refused."""
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    ready, go = tmp_path / "ready", tmp_path / "go"
    launch = tmp_path / "launch.py"
    launch.write_text(LAUNCH.format(patch=WAIT_AT_CHUNK_2.format(ready=str(ready), go=str(go))))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(launch), *_args(tiny_model_dir, data, out)],
                            env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not ready.exists():  # rank 0 holds at chunk 2, rank 1 scores its chunks
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        assert [p.name for p in parts.glob("*.lock")] == ["run.lock"]
        shard = _cli(_args(tiny_model_dir, data, out, "--shard", "1/2"))
        _, err = shard.communicate(timeout=300)
        assert shard.returncode == 2 and "a live run (pid " in err and ", the whole run) owns " in err
    finally:
        go.touch()
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    _same(out, reference)
    assert not parts.exists()


def test_a_killed_run_leaves_a_stale_lock_that_resume_takes_over(tmp_path, tiny_model_dir, data, reference):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    proc = _held_before_chunk_2(tmp_path, _args(tiny_model_dir, data, out))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (parts / "run.lock").exists()
    resumed = _cli(_args(tiny_model_dir, data, out, "--resume"))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"took over {parts}: its lock run.lock was left by pid {proc.pid} on host {socket.gethostname()}" in err
    _same(out, reference)


def _flip_a_bit(path, at):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_part_whose_bytes_changed_is_scored_again_never_merged(tmp_path, tiny_model_dir, data, reference, capsys):
    """A bit flipped in a part's data (the kind a Parquet reader does not notice: a float's low bit)
    or a part without its checksum (its write cut short) is damaged: merge refuses it, --resume
    moves it aside and scores its chunk again."""
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--no-merge")) == 0
    part = parts / "00000001.parquet"
    _flip_a_bit(part, 200)  # inside the first column chunk's values
    pq.read_table(part)  # still reads
    (parts / "00000004.parquet.sha256").unlink()
    capsys.readouterr()
    assert main(["merge", "--out", str(out)]) == 2
    err = _error(capsys)
    assert "00000001.parquet: damaged, its bytes differ from those written (checksum mismatch)" in err
    assert "00000004.parquet: damaged, no checksum beside it" in err and not out.exists()
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
    assert _files(tmp_path / "s.parquet.damaged", checksums=True) == ["00000001.parquet", "00000001.parquet.sha256",
                                                                      "00000004.parquet"]
    _same(out, reference)


def test_a_model_is_the_same_however_its_path_is_typed(tmp_path, tiny_model_dir, data, reference, monkeypatch):
    """models/tiny, ./models/tiny and its absolute path are one model: a resume under any of them continues."""
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "s.parquet"
    assert main(_args("models/tiny", data, out, "--shard", "0/3")) == 0
    assert main(_args("./models/tiny", data, out, "--shard", "1/3")) == 0
    assert main(_args(str(tmp_path / "models" / "tiny"), data, out, "--resume")) == 0
    assert pq.read_table(out).equals(reference)  # the rows; the metadata records the name first typed
    assert gradspec.read_metadata(out)["model"] == "models/tiny"


def test_a_resume_under_other_threads_is_refused_with_the_way_to_continue(tmp_path, tiny_model_dir, data, reference,
                                                                          capsys):
    """The rows' last bits depend on torch's thread count: a run begun with one thread (as torchrun's
    ranks run) is not continued by two, which would write parts that differ from its own."""
    out = tmp_path / "s.parquet"
    assert main(_args(tiny_model_dir, data, out, "--shard", "0/2")) == 0
    torch.set_num_threads(2)
    try:
        capsys.readouterr()
        assert main(_args(tiny_model_dir, data, out, "--resume")) == 2
    finally:
        torch.set_num_threads(1)
    err = _error(capsys)
    assert err.startswith(f"cannot continue the run in {tmp_path / 's.parquet.parts'} bit for bit: numerics: ")
    assert "its parts were computed with 1 thread (torchrun sets OMP_NUM_THREADS=1): run with OMP_NUM_THREADS=1 " \
           "to continue it, or pass --overwrite to start again" in err
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
    _same(out, reference)
    assert json.loads(pq.read_schema(out).metadata[b"gradspec"])["numerics"]["threads"] == 1


def _merge_stopped_after_its_file(monkeypatch, deleted: int):
    """merge stopped (a kill) after its file is in place, having deleted `deleted` of the parts."""
    real = run_folder.RunFolder.clear

    def clear(self):
        if self.out.exists():
            for p in sorted(self.path.glob("*.parquet"))[:deleted]:
                p.unlink()
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(run_folder.RunFolder, "clear", clear)


@pytest.mark.parametrize("then", ["resume", "merge", "score"])
def test_a_merge_stopped_after_its_file_is_finished_by_the_next_command(tmp_path, tiny_model_dir, data, reference,
                                                                      monkeypatch, capsys, then):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--no-merge")) == 0
    (parts / "notes.txt").write_text("mine")
    with monkeypatch.context() as patched:
        _merge_stopped_after_its_file(patched, deleted=2)
        assert main(["merge", "--out", str(out)]) == 130
    assert (parts / "manifest.json").exists() and len(list(parts.glob("*.parquet"))) == 4
    capsys.readouterr()
    if then == "resume":  # a finished run resumed: nothing to do, and it says so
        assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
        assert "was already complete: nothing to resume" in capsys.readouterr().out
    elif then == "merge":
        assert main(["merge", "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == f"{out}: already merged (removed the parts a stopped merge left)"
    else:  # a new run into it is refused as for any finished file
        assert main(_args(tiny_model_dir, data, out)) == 2
        assert _error(capsys) == f"{out} exists; pass --overwrite or choose another --out"
    _same(out, reference)
    assert _files(parts) == ["notes.txt"]


def test_a_merge_killed_while_writing_leaves_no_temporary(tmp_path, tiny_model_dir, data, reference):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--no-merge")) == 0
    ready, go = tmp_path / "ready", tmp_path / "go"
    # holds after the first part
    halfway = ("import os, time, gradspec.runs.run_folder.merge as rf; real = rf.conformed\n"
               "def conformed(table, schema):\n"
               f"    if os.path.exists({str(ready)!r}):\n"
               f"        while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
               f"    open({str(ready)!r}, 'w').close()\n"
               "    return real(table, schema)\n"
               "rf.conformed = conformed")
    merging = _cli(["merge", "--out", str(out)], halfway)
    _wait_for(ready, merging)
    time.sleep(0.5)
    merging.send_signal(signal.SIGKILL)
    merging.wait()
    assert [p.name for p in tmp_path.glob("s.parquet.tmp*")] == [f"s.parquet.tmp{merging.pid}"]
    assert main(["merge", "--out", str(out)]) == 0
    _same(out, reference)
    assert not list(tmp_path.glob("s.parquet.tmp*")) and not parts.exists()


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path, tiny_model_dir, data, reference):
    """A scheduler's SIGTERM: one line, exit 143, the lock released and no temporary left; --resume continues."""
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    proc = _held_before_chunk_2(tmp_path, _args(tiny_model_dir, data, out))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("gradspec: terminated (a scoring run keeps the parts it finished: the same "
                                            "command with --resume continues it)")
    assert _files(parts, checksums=True) == ["00000000.parquet", "00000000.parquet.sha256", "00000001.parquet",
                                             "00000001.parquet.sha256", "manifest.json"]
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
    _same(out, reference)


def test_a_damaged_manifest_is_written_again_by_resume(tmp_path, tiny_model_dir, data, reference, capsys):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--shard", "0/2")) == 0
    manifest = (parts / "manifest.json").read_text()
    (parts / "manifest.json").write_text(manifest[: len(manifest) // 2])  # a write cut short
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, out)) == 2
    err = _error(capsys)
    assert err.startswith(f"{parts / 'manifest.json'}: not a run's manifest (")
    assert err.endswith("the run's parts are intact: pass --resume to continue it (the parts of this config are "
                        "kept, the manifest written again)")
    assert main(_args(tiny_model_dir, data, out, "--resume")) == 0
    _same(out, reference)


def test_a_full_disk_is_named_and_leaves_no_temporary(tmp_path, tiny_model_dir, data, monkeypatch, capsys):
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    real = pathlib.Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name.startswith("manifest.json.tmp"):
            real(self, "", *args, **kwargs)  # the file made, nothing fits in it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    assert main(_args(tiny_model_dir, data, out)) == 2
    assert not parts.exists()  # nothing left: no zero-byte manifest temporary, no lock
    monkeypatch.undo()
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and ".parquet.tmp" in str(path) and "00000002" in str(path):
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return f

    monkeypatch.setattr("gradspec.files.primitives.open", full, raising=False)
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, out)) == 2
    assert _error(capsys) == f"[Errno 28] No space left on device (writing it): '{parts / '00000002.parquet'}'"
    assert _files(parts, checksums=True) == ["00000000.parquet", "00000000.parquet.sha256", "00000001.parquet",
                                             "00000001.parquet.sha256", "manifest.json"]


def test_a_merge_stopped_before_its_file_is_in_place_loses_no_skipped_row(tmp_path, tiny_model_dir, data,
                                                                          monkeypatch):
    """The skipped rows' file is written before the output is renamed into place: once the output is
    there, the next command may remove the parts, and with them the only other record of those rows."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + '{"instruction": "no output"}\n')
    out = tmp_path / "s.parquet"
    assert main(_args(tiny_model_dir, bad, out, "--no-merge", "--on-error", "skip")) == 0
    real = run_merge.atomic_write

    def atomic_write(path, write):
        if path == out.with_suffix(".errors.jsonl"):
            raise KeyboardInterrupt
        real(path, write)

    with monkeypatch.context() as patched:
        patched.setattr(run_merge, "atomic_write", atomic_write)
        assert main(["merge", "--out", str(out)]) == 130
    assert not out.exists()
    assert main(["merge", "--out", str(out)]) == 0
    assert json.loads(out.with_suffix(".errors.jsonl").read_text())["index"] == ROWS


FLUSHED = ["--chunk-rows", "24", "--batch-tokens", "48", "--flush-minutes", "0.01"]  # one chunk, many batches


def _stopped_within_a_chunk(tmp_path, model, data, monkeypatch):
    """The uninterrupted run's file, and a run of one chunk stopped at its 5th batch having written the rows of
    its first 4 (every --flush-minutes: here every batch, the clock pushed on; the 4th as it stopped); the batch
    sizes submitted."""
    from gradspec.runs import chunks

    whole, stopped = tmp_path / "whole.parquet", tmp_path / "stopped.parquet"
    assert main(_args(model, data, whole, *FLUSHED)) == 0
    clock = iter(range(0, 10**6, 60))
    monkeypatch.setattr(chunks.time, "monotonic", lambda: next(clock))
    submitted = []
    real_submit = gradspec.SpectralEngine.submit

    def submit(self, ids, *rest):
        if len(submitted) == 4:
            raise KeyboardInterrupt
        submitted.append(ids.shape[0])
        return real_submit(self, ids, *rest)

    monkeypatch.setattr(gradspec.SpectralEngine, "submit", submit)
    assert main(_args(model, data, stopped, *FLUSHED)) == 130
    monkeypatch.setattr(gradspec.SpectralEngine, "submit", real_submit)
    return whole, stopped, submitted


def test_a_stopped_run_loses_at_most_its_flush_minutes_and_resumes_to_the_same_file(tmp_path, tiny_model_dir, data,
                                                                                     monkeypatch):
    """A run stopped within a chunk had written the rows scored so far; the resume scores only the others, in the
    batches they had, and the file equals the uninterrupted run's, bit for bit."""
    whole, stopped, submitted = _stopped_within_a_chunk(tmp_path, tiny_model_dir, data, monkeypatch)
    parts = tmp_path / "stopped.parquet.parts"
    partial = pq.read_table(parts / "00000000.partial.parquet")
    assert partial.num_rows == sum(submitted) and not (parts / "00000000.parquet").exists()
    assert (parts / "00000000.partial.parquet.sha256").exists()
    resumed = []
    real_submit = gradspec.SpectralEngine.submit
    monkeypatch.setattr(gradspec.SpectralEngine, "submit", lambda self, ids, *rest: resumed.append(ids.shape[0])
                        or real_submit(self, ids, *rest))
    assert main(_args(tiny_model_dir, data, stopped, *FLUSHED, "--resume")) == 0
    assert sum(resumed) == ROWS - partial.num_rows
    assert pq.read_table(stopped).equals(pq.read_table(whole), check_metadata=True)
    assert not (tmp_path / "stopped.parquet.parts").exists()


@pytest.mark.parametrize("damage", ["a value's bit flipped", "no checksum"])
def test_a_damaged_partial_part_is_set_aside_and_its_rows_scored_again(tmp_path, tiny_model_dir, data, monkeypatch,
                                                                       caplog, damage):
    """A partial part is a part: a bit flipped in one of its values (Parquet still reads it) or a write cut short
    before its checksum is damaged; the resume moves it to <out>.damaged/, scores its rows again, and the file
    equals the uninterrupted run's."""
    whole, stopped, _ = _stopped_within_a_chunk(tmp_path, tiny_model_dir, data, monkeypatch)
    partial = tmp_path / "stopped.parquet.parts" / "00000000.partial.parquet"
    if damage == "no checksum":
        (tmp_path / "stopped.parquet.parts" / "00000000.partial.parquet.sha256").unlink()
    else:
        table = pq.read_table(partial)
        raw = bytearray(partial.read_bytes())
        loss = table.column("loss")[0].as_py()
        at = bytes(raw).index(__import__("struct").pack("<d", loss))  # the first row's loss, as stored
        raw[at] ^= 0x10  # its lowest byte: still a valid double
        partial.write_bytes(bytes(raw))
        assert pq.read_table(partial).column("loss")[0].as_py() != loss  # still reads, with another value
    assert main(_args(tiny_model_dir, data, stopped, *FLUSHED, "--resume")) == 0
    assert pq.read_table(stopped).equals(pq.read_table(whole), check_metadata=True)
    assert (tmp_path / "stopped.parquet.damaged" / "00000000.partial.parquet").exists()
    assert "00000000.partial.parquet: damaged" in caplog.text and "its rows are scored again" in caplog.text


def test_rows_taken_back_from_a_partial_write_are_the_rows_that_were_written(tmp_path):
    """Types as written (a float32 projection stays float32, not double), and a value a row did not have yet
    (None) unset again, as in a fresh row, not kept as a null."""
    import numpy as np

    folder = run_folder.RunFolder(tmp_path / "s.parquet")
    folder.path.mkdir()
    rows = [{"index": 0, "status": "ok", "loss": 1.0, "a/m": 2.0, "projected_gradient": np.arange(3, dtype=np.float32)},
            {"index": 1, "status": "out_of_memory", "loss": 3.0}]
    folder.write_partial(0, rows)
    back = folder.partial_rows(0)
    assert back[0]["projected_gradient"].dtype == np.float32 and "a/m" not in back[1]
    assert run_folder.rows_table(back).equals(run_folder.rows_table(rows))


def _finished(proc, timeout=300):
    """proc's exit code and stderr; a process still running after timeout (blocked) is killed and fails the test."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running after {timeout} s: {proc.args[3:]}")
    return proc.returncode, err


def test_a_fifo_where_a_part_should_be_is_refused_not_waited_on(tmp_path, tiny_model_dir, data, reference):
    """A FIFO in a part's place would block its reader past any signal: merge names it damaged (exit 2), and
    --resume moves it aside and scores its chunk again."""
    out, parts = tmp_path / "s.parquet", tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--no-merge")) == 0
    fifo = parts / "00000002.parquet"
    fifo.unlink()
    os.mkfifo(fifo)
    code, err = _finished(_cli(["merge", "--out", str(out)]))
    assert code == 2 and f"00000002.parquet: damaged, not a readable Parquet file ({fifo}: a FIFO (named pipe), " \
        "not a regular file)" in err, err
    code, err = _finished(_cli(_args(tiny_model_dir, data, out, "--resume")))
    assert code == 0, err
    _same(out, reference)
    assert (tmp_path / "s.parquet.damaged" / "00000002.parquet").is_fifo()


def test_a_fifo_given_as_data_is_refused_before_it_is_opened(tmp_path, tiny_model_dir):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    code, err = _finished(_cli(_args(tiny_model_dir, fifo, tmp_path / "s.parquet")), timeout=120)
    assert code == 2 and err.strip().splitlines() == [
        f"gradspec: error: {fifo}: a FIFO (named pipe), not a regular file; give a JSON, JSONL or Parquet file, or a "
        "dataset folder"], err


def test_ctrl_c_keeps_the_rows_of_the_unfinished_chunk_and_resume_scores_only_the_others(tmp_path, tiny_model_dir,
                                                                                         monkeypatch, caplog):
    """With the default chunk (1,024 rows) and flush (10 minutes), a run of 64 rows stopped at 90% had written
    nothing: Ctrl-C (or SIGTERM, or a failure) now writes the rows scored so far as a flush does; --resume scores
    only the others and the file equals the uninterrupted run's, bit for bit."""
    data = tmp_path / "d64.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Question {i}: " + "why " * (i % 5),
                                        "output": "Because " + "so " * (1 + i % 7)}) + "\n" for i in range(64)))

    def args(out, *extra):
        return ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--batch-tokens",
                "128", "--quiet", *extra]

    whole, stopped = tmp_path / "whole.parquet", tmp_path / "stopped.parquet"
    assert main(args(whole)) == 0
    real_submit, submitted = gradspec.SpectralEngine.submit, []

    def submit(self, ids, *rest):
        if sum(submitted) >= 0.9 * 64:
            raise KeyboardInterrupt
        submitted.append(ids.shape[0])
        return real_submit(self, ids, *rest)

    monkeypatch.setattr(gradspec.SpectralEngine, "submit", submit)
    assert main(args(stopped)) == 130
    kept = pq.read_table(tmp_path / "stopped.parquet.parts" / "00000000.partial.parquet").num_rows
    assert kept == sum(submitted) and len(submitted) > 1  # the last batch's scores were ready: kept too
    resumed = []
    monkeypatch.setattr(gradspec.SpectralEngine, "submit", lambda self, ids, *rest: resumed.append(ids.shape[0])
                        or real_submit(self, ids, *rest))
    caplog.clear()
    assert main(args(stopped, "--resume")) == 0
    assert sum(resumed) == 64 - kept
    assert f"chunk 0: {kept} rows scored before the run stopped, taken back" in caplog.text
    assert pq.read_table(stopped).equals(pq.read_table(whole), check_metadata=True)
