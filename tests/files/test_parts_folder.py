"""gradspec.files.parts: a scoring run's folder and a monitor's are one kind of folder, the same parts
listed and compacted the same way, one writer at a time, and only the writer's own files deleted."""

import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.files.locks import RunLocked
from gradspec.files.parts import part_files
from gradspec.runs.run_folder import RunFolder
from gradspec.training.monitor_parts import MonitorParts, read_monitor

USERS = ("1.parquet", "00000001.parquet.bak", "notes.txt")  # a user's files, some named like parts


def test_a_run_folder_and_a_monitor_list_the_same_parts_and_delete_only_theirs(tmp_path):
    """A part is NNNNNNNN.parquet, 8 digits at least (chunk 123,456,789 has 9): the run folder counted
    1.parquet as chunk 1's part, and left a 9-digit part of its own when it cleared the folder."""
    folder = tmp_path / "s.parquet.parts"
    folder.mkdir()
    for name in ("00000000.parquet", "123456789.parquet", "00000002.partial.parquet", *USERS):
        (folder / name).write_text("")
    run = RunFolder(tmp_path / "s.parquet")
    assert run.done() == {0, 123456789}
    assert [p.name for p in part_files(folder)] == ["00000000.parquet", "123456789.parquet"]
    monitor = MonitorParts(tmp_path / "s.parquet")
    monitor.clear()
    assert sorted(p.name for p in folder.iterdir()) == sorted(["00000002.partial.parquet", *USERS])
    run.clear()
    assert sorted(p.name for p in folder.iterdir()) == sorted(USERS)


HOLDS = """
import sys, time
import pyarrow as pa
from gradspec.training.monitor_parts import MonitorParts
parts = MonitorParts(sys.argv[1])
parts.open(overwrite=False, resumed_at=None)
for step in range(2):
    parts.write(pa.table({"step": [step, step]}))
open(sys.argv[2], "w").close()
while not __import__("os").path.exists(sys.argv[3]):
    time.sleep(0.02)
parts.compact()
"""


def test_a_second_monitor_process_is_refused_and_nothing_of_the_first_deleted(tmp_path):
    """One writer to a monitor's parts (its run.lock): another process's monitor on the same out, even with
    overwrite, is refused naming the live one, and the first's parts and a user's files stay; once the first
    has compacted its parts, an overwrite deletes its file and nothing of the user's."""
    out, ready, go = tmp_path / "m.parquet", tmp_path / "ready", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", HOLDS, str(out), str(ready), str(go)])
    try:
        while not ready.exists():
            assert first.poll() is None
            time.sleep(0.02)
        folder = tmp_path / "m.parquet.parts"
        for name in USERS:
            (folder / name).write_text("mine")
        second = MonitorParts(out)
        with pytest.raises(RunLocked, match=rf"a live run \(pid {first.pid} on host .*, the whole run\) owns "
                                            rf"{folder}: wait for it to finish or stop it"):
            second.open(overwrite=True, resumed_at=None)
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["00000000.parquet", "00000000.parquet.sha256", "00000001.parquet", "00000001.parquet.sha256",
             "run.lock", *USERS])
        go.touch()
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        first.wait()
    assert read_monitor(out)["step"].tolist() == [0, 0, 1, 1]
    assert sorted(p.name for p in folder.iterdir()) == sorted(USERS)
    second.open(overwrite=True, resumed_at=None)
    second.write(pa.table({"step": [7]}))
    second.compact()
    assert not out.with_name("m.parquet.tmp").exists() and pq.read_table(out)["step"].to_pylist() == [7]
    assert sorted(p.name for p in folder.iterdir()) == sorted(USERS)
