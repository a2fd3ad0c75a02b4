"""A monitor's parts folder is guarded as a scoring run's folder is: no link followed to it, one writer
(its run.lock: a live scoring run or a second monitor on the same out is refused, nothing of theirs
deleted), only the monitor's own files deleted, and each part checksummed."""

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import tiny_model

from gradspec.errors import InputError
from gradspec.files.locks import RunLocked
from gradspec.options import OptionError
from gradspec.training.monitor import SpectralMonitor
from gradspec.training.monitor_parts import read_monitor
from gradspec.training.wit import WITCollator

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
]


def _steps(monitor, model, tokenizer, steps):
    for step in steps:
        monitor.begin(model, step)
        model(**WITCollator(tokenizer)(ROWS[step % 2 : step % 2 + 2])).loss.backward()
        monitor.end()


def _users_folder(tmp_path):
    """A folder of the user's own files, named like parts."""
    mine = tmp_path / "mine"
    mine.mkdir()
    pq.write_table(pa.table({"x": [1]}), mine / "00000000.parquet")
    return mine, (mine / "00000000.parquet").read_bytes()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_linked_parts_folder_is_refused_and_what_it_points_to_kept(tokenizer, tmp_path, overwrite):
    mine, held = _users_folder(tmp_path)
    out = tmp_path / "ml.parquet"
    (tmp_path / "ml.parquet.parts").symlink_to(mine)
    monitor = SpectralMonitor(every=1, modules="q", out=out, overwrite=overwrite)
    with pytest.raises(OptionError, match=r"ml\.parquet\.parts: a symbolic link; gradspec writes and deletes in"):
        _steps(monitor, tiny_model("llama"), tokenizer, [1])
    monitor.close()
    assert sorted(p.name for p in mine.iterdir()) == ["00000000.parquet"]
    assert (mine / "00000000.parquet").read_bytes() == held and not out.exists()


LIVE_SCORE_RUN = """
import sys, time
from gradspec.runs.run_folder import RunFolder
folder = RunFolder(sys.argv[1])
folder.acquire()
for chunk in range(5):
    (folder.path / f"{chunk:08d}.parquet").write_bytes(b"a part")
open(sys.argv[2], "w").close()
time.sleep(600)
"""


def test_a_live_scoring_run_s_folder_is_refused_and_nothing_of_it_deleted(tokenizer, tmp_path):
    """A scoring run (another process) holds run.lock in live.parquet.parts: a monitor with overwrite on the same
    out is refused at its first step, and the run's parts stay."""
    out, ready = tmp_path / "live.parquet", tmp_path / "ready"
    run = subprocess.Popen([sys.executable, "-c", LIVE_SCORE_RUN, str(out), str(ready)])
    try:
        while not ready.exists():
            assert run.poll() is None
        monitor = SpectralMonitor(every=1, modules="q", out=out, overwrite=True)
        with pytest.raises(RunLocked, match=rf"a live run \(pid {run.pid} on host .*\) owns .*live\.parquet\.parts"):
            _steps(monitor, tiny_model("llama"), tokenizer, [1])
        monitor.close()
        assert sorted(p.name for p in (tmp_path / "live.parquet.parts").iterdir()) == \
            [f"0000000{i}.parquet" for i in range(5)] + ["run.lock"]
        assert not out.exists()
    finally:
        run.kill()
        run.wait()


def test_two_monitors_on_one_out_the_second_is_refused(tokenizer, tmp_path):
    """One writer: the second monitor on the same out is refused at its first step, the first one's rows all kept."""
    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    first, second = (SpectralMonitor(every=1, modules="q", out=out) for _ in range(2))
    _steps(first, model, tokenizer, [1])
    mine = r"this process \(pid \d+, the whole run\) already writes in .*m\.parquet\.parts"
    with pytest.raises(RunLocked, match=mine):
        _steps(second, model, tokenizer, [1])
    _steps(first, model, tokenizer, [2])
    first.close()
    assert read_monitor(out)["step"].tolist() == [1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"m\.parquet: exists \(a previous run's rows\)"):  # the folder free again
        _steps(second, model, tokenizer, [3])


def test_a_monitor_dropped_unclosed_frees_its_folder(tokenizer, tmp_path):
    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    dropped = SpectralMonitor(every=1, modules="q", out=out)
    _steps(dropped, model, tokenizer, [1])
    del dropped
    again = SpectralMonitor(every=1, modules="q", out=out, overwrite=True)
    _steps(again, model, tokenizer, [2])
    again.close()
    assert read_monitor(out)["step"].tolist() == [2, 2]


def test_overwrite_deletes_only_the_monitor_s_own_files(tokenizer, tmp_path):
    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    first = SpectralMonitor(every=1, modules="q", out=out)
    _steps(first, model, tokenizer, [1])
    first.restart()  # stopped unclosed: its parts stay
    parts = tmp_path / "m.parquet.parts"
    for name in ("notes.txt", "000001.parquet", "00000000.parquet.bak", "mine.parquet"):
        (parts / name).write_text("mine")
    again = SpectralMonitor(every=1, modules="q", out=out, overwrite=True)
    _steps(again, model, tokenizer, [2])
    again.close()
    assert sorted(p.name for p in parts.iterdir()) == sorted(["000001.parquet", "00000000.parquet.bak",
                                                                "mine.parquet", "notes.txt"])


def test_a_part_whose_bytes_changed_is_refused_by_read_monitor(tokenizer, tmp_path):
    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    monitor = SpectralMonitor(every=1, modules="q", out=out)
    _steps(monitor, model, tokenizer, [1, 2])
    part = tmp_path / "m.parquet.parts" / "00000001.parquet"
    assert (tmp_path / "m.parquet.parts" / "00000001.parquet.sha256").exists()
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    part.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"00000001\.parquet: damaged, its bytes differ from those written"):
        read_monitor(out)
    monitor.restart()


def test_a_fifo_among_the_parts_is_refused_not_waited_on(tmp_path):
    parts = tmp_path / "m.parquet.parts"
    parts.mkdir()
    os.mkfifo(parts / "00000000.parquet")
    code = ("import sys\nfrom gradspec.training.monitor_parts import read_monitor\n"
            "try:\n    read_monitor(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.parquet")], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.startswith(f"NotRegularFile {parts / '00000000.parquet'}: a FIFO (named pipe)"), done
