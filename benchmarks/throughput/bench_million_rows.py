"""Million-row score files (issue 39, item 3): time and peak RSS of `gradspec merge`, `gradspec select`,
`gradspec report` and a filtered `read_scores` on 1,000,000 rows of a 7B model's width, each in a fresh process
(targets: 3 minutes and 2 GB each).

The score file is synthetic, laid out as a real run of Llama-2-7B with ``--modules all`` leaves it: 32 layers of
q/k/v/o/gate/up/down, 6 metrics each, beside index, status, loss, num_tokens and num_response_tokens (1,349
columns); 1% of the rows prompt_too_long (NaN loss and metrics), 2% truncated. A run folder of 1,024-row parts
(the default --chunk-rows: 977 parts, each with its checksum, as `gradspec score --no-merge` writes them) is
written once, with the 1,000,000-row JSONL it scored, and cached outside the repository, under
$GRADSPEC_BENCH_CACHE (default /tmp/gradspec-million/) in a folder named by its parameters: about 25 GB (the
parts and the merged file); delete it yourself when done. The merge is timed on a copy of the parts made of hard
links (merging deletes the parts it merged), and its output is kept as the file the other commands read.

Peak RSS is each child's own (os.wait4's rusage of that process alone), its time the wall time from start to
exit. Run with ``pytest benchmarks/throughput/bench_million_rows.py -s`` (BENCH_MILLION_ROWS=20000 for a small trial;
BENCH_REPEAT=1 merges again when the merged file is cached, which the merge row otherwise times only once).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.common import child_env, peak_rss_in, with_peak_rss

ROWS = int(os.environ.get("BENCH_MILLION_ROWS", 1_000_000))
LAYERS, HIDDEN, INTERMEDIATE = 32, 4096, 11008  # Llama-2-7B
CHUNK_ROWS = 1024  # gradspec score's default --chunk-rows
ROLES = [("self_attn.q_proj", "q", HIDDEN, HIDDEN), ("self_attn.k_proj", "k", HIDDEN, HIDDEN),
         ("self_attn.v_proj", "v", HIDDEN, HIDDEN), ("self_attn.o_proj", "o", HIDDEN, HIDDEN),
         ("mlp.gate_proj", "gate", HIDDEN, INTERMEDIATE), ("mlp.up_proj", "up", HIDDEN, INTERMEDIATE),
         ("mlp.down_proj", "down", INTERMEDIATE, HIDDEN)]
CACHE = Path(os.environ.get("GRADSPEC_BENCH_CACHE", "/tmp/gradspec-million")) / \
    f"rows{ROWS}-layers{LAYERS}-chunk{CHUNK_ROWS}-v1"
SECONDS, MIB = 180, 2048  # the targets, each command
READ_SCORES = ("import gradspec\n"
               "wide, long = gradspec.read_scores({path!r}, modules=['model.layers.31.*'],\n"
               "                                  metrics=['effective_rank', 'stable_rank'])\n"
               "print(f'read {{len(wide)}} rows, {{wide.shape[1]}} columns; long form {{len(long)}} rows')\n")
RESULTS: dict[str, tuple[float, float, str]] = {}  # command: (seconds, peak RSS MiB, what it printed)


def timed(argv: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MiB, stdout) of a child process run to its end; fails if it fails."""
    env = child_env()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        child = subprocess.Popen(with_peak_rss(argv), stdout=out, stderr=err, cwd=cwd, env=env)
        _, status, _ = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        printed, errors = out.read().decode(), err.read().decode()
    assert child.returncode == 0, f"{argv} failed ({child.returncode}):\n{printed}\n{errors}"
    return seconds, peak_rss_in(errors), printed.strip()


def gradspec(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradspec", *args]


def _part_table(rng: np.random.Generator, first: int, rows: int, names: list[str]) -> pa.Table:
    """A chunk's rows as a run writes them (rows.with_every_column: unscored rows have NaN loss and metrics)."""
    index = np.arange(first, first + rows, dtype=np.int64)
    draw = rng.random(rows)
    status = np.where(draw < 0.01, "prompt_too_long", np.where(draw < 0.03, "truncated", "ok"))
    scored = status != "prompt_too_long"
    tokens = rng.integers(64, 2048, rows)
    values = rng.gamma(2.0, 20.0, (len(names), rows))
    values[:, ~scored] = np.nan
    columns = {"index": index, "status": pa.array(status.tolist(), pa.string()),
               "loss": np.where(scored, rng.gamma(2.0, 0.7, rows), np.nan), "num_tokens": tokens,
               "num_response_tokens": np.minimum(tokens, rng.integers(1, 512, rows))}
    columns.update(zip(names, values, strict=True))
    return pa.table(columns)


def _write_run(root: Path) -> None:
    """The scored input and its finished run folder (root/run/s.parquet.parts), as `gradspec score --no-merge`
    leaves them."""
    from types import SimpleNamespace

    from gradspec.linalg.metrics import METRICS
    from gradspec.runs.config import ScoreConfig
    from gradspec.runs.run_folder import NUMERICS, RunFolder
    from gradspec.runs.score_files import column, file_metadata

    data = root / "d.jsonl"
    with open(data, "w") as f:
        for i in range(ROWS):
            f.write(json.dumps({"instruction": f"Question {i}: what is {i} plus one?", "output": f"It is {i + 1}."})
                    + "\n")
    parts = [SimpleNamespace(name=f"model.layers.{layer}.{name}", role=role, d_in=d_in, d_out=d_out)
             for layer in range(LAYERS) for name, role, d_in, d_out in ROLES]
    names = [column(p.name, m) for p in parts for m in METRICS]
    config = ScoreConfig(data=str(data), model="meta-llama/Llama-2-7b-hf", modules="all", chunk_rows=CHUNK_ROWS)
    info = json.loads(json.dumps({**config.describe(), "model_path": "meta-llama/Llama-2-7b-hf",
                                  "model_fingerprint": None, NUMERICS: {}}))
    metadata = file_metadata(parts, METRICS, info)
    folder = RunFolder(root / "run" / "s.parquet")
    folder.start(info, resume=False, overwrite=False, records=ROWS)
    rng = np.random.default_rng(0)
    try:
        for chunk, first in enumerate(range(0, ROWS, CHUNK_ROWS)):
            folder.write_table(chunk, _part_table(rng, first, min(CHUNK_ROWS, ROWS - first), names), metadata)
    finally:
        folder.release()


@pytest.fixture(scope="module")
def run_parts() -> Path:
    """The cached run: CACHE/d.jsonl and its parts in CACHE/run/s.parquet.parts (written the first time)."""
    if not (CACHE / "complete").exists():
        if CACHE.exists():
            shutil.rmtree(CACHE)  # a write that was stopped
        CACHE.mkdir(parents=True)
        start = time.perf_counter()
        _write_run(CACHE)
        (CACHE / "complete").write_text("")
        size = sum(p.stat().st_size for p in (CACHE / "run").rglob("*")) / 2**30
        print(f"\nwrote {ROWS:,} rows in {len(list((CACHE / 'run').rglob('*.parquet')))} parts "
              f"({size:.1f} GiB) to {CACHE} in {time.perf_counter() - start:.0f} s; delete it when done")
    return CACHE


def _merge(cache: Path) -> Path:
    """Times `gradspec merge` of a hard-linked copy of the parts; returns the merged file."""
    work = cache / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(cache / "run", work, copy_function=os.link)
    RESULTS["merge"] = timed(gradspec("merge", "--out", str(work / "s.parquet"), "--quiet"), cache)
    assert f"wrote {ROWS} rows" in RESULTS["merge"][2]
    return work / "s.parquet"


@pytest.fixture(scope="module")
def merged(run_parts) -> Path:
    """The merged file, cached beside the parts (merged, and timed, the first time)."""
    path = run_parts / "merged.parquet"
    if not path.exists():
        os.replace(_merge(run_parts), path)
        shutil.rmtree(run_parts / "work")
    return path


def test_merge(run_parts, merged):
    if "merge" not in RESULTS or os.environ.get("BENCH_REPEAT"):
        _merge(run_parts)
        assert (run_parts / "work" / "s.parquet").stat().st_size == merged.stat().st_size
        shutil.rmtree(run_parts / "work")


def test_select(merged, tmp_path):
    out = tmp_path / "chosen.jsonl"
    RESULTS["select"] = timed(gradspec("select", "--scores", str(merged), "--by", "effective_rank", "--fraction",
                                       "0.1", "--out", str(out), "--quiet"), tmp_path)
    assert RESULTS["select"][2].startswith("wrote ")


def test_report(merged, tmp_path):
    RESULTS["report"] = timed(gradspec("report", f"all={merged}", "--out", str(tmp_path / "report"), "--quiet"),
                              tmp_path)
    assert (tmp_path / "report" / "report.md").exists()


def test_read_scores(merged, tmp_path):
    RESULTS["read_scores"] = timed([sys.executable, "-c", READ_SCORES.format(path=str(merged))], tmp_path)
    assert RESULTS["read_scores"][2] == f"read {ROWS} rows, 19 columns; long form {14 * ROWS} rows"


def test_table(merged):
    rows = {"merge": "`gradspec merge` of the 977 parts" if ROWS == 1_000_000 else "`gradspec merge` of the parts",
            "select": "`gradspec select --by effective_rank --fraction 0.1` (to .jsonl)",
            "report": "`gradspec report all=<file>` (one group)",
            "read_scores": "`read_scores(modules=['model.layers.31.*'], metrics=[2 of 6])`"}
    if not rows.keys() <= RESULTS.keys():
        pytest.skip("run the whole file")
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    print(f"\n{datetime.date.today()}, {cpu}, {os.cpu_count()} cores; {ROWS:,} rows x "
          f"{len(pq.read_schema(merged).names):,} columns, {merged.stat().st_size / 2**30:.1f} GiB merged")
    print("\n| command | seconds | peak RSS (MiB) | target: <= 180 s, <= 2,048 MiB |\n| --- | ---: | ---: | --- |")
    for name, label in rows.items():
        seconds, mib, _ = RESULTS[name]
        over = [what for what, past in (("time", seconds > SECONDS), ("memory", mib > MIB)) if past]
        met = "**not met**: " + " and ".join(over) if over else "met"
        print(f"| {label} | {seconds:.1f} | {mib:,.0f} | {met} |")
    for name in rows:
        print(f"{name}: {RESULTS[name][2].splitlines()[-1] if RESULTS[name][2] else ''}")
