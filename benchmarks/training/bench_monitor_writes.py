"""The spectral monitor's output over a long run: write time per monitored step, the parts writer (a
part per step in <out>.parts/, compacted at close) against a whole-file rewrite, and the
memory of a long monitored run of a tiny model.

Write time: synthetic rows of the width of the tests' tiny Llama (2 layers, all 14 modules, every
metric: 95 columns), 8 a step. The parts writer is SpectralMonitor's own (``_write``, then ``close``),
run step by step to PARTS_STEPS. The whole-file rewrite is re-implemented here as the baseline (every
row so far concatenated, written aside and renamed), run step by step beside it, each step's two writes
one after the other so that both see the machine's load of the moment, to WHOLE_STEPS only (its writes
add up quadratically: 10,000 steps, about an hour here). At the points from WHOLE_STEPS on, its state
at step s (s - 1 tables of 8 rows concatenated, as its table was) is built in memory and one write
timed, WHOLE_ROUNDS times; at WHOLE_STEPS both ways are measured, to check the shortcut. Each point is
the median of the 10 steps (or rounds) that end there.

Memory: a fresh process trains a tiny random Llama (2 layers, width 64) with the monitor on every
module at every step for RSS_STEPS steps of 8 rows (a plain loop), and reports its resident set size
along the way and its peak.

Run with ``pytest benchmarks/training/bench_monitor_writes.py -s``; the figures print at the end.
"""

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.common import MEDIANS, REPO, child_env
from gradspec.files import atomic_write, write_checksummed
from gradspec.linalg.metrics import metric_names
from gradspec.training.monitor import SpectralMonitor
from gradspec.training.monitor_rows import COLUMN_TYPES

POINTS = (10, 100, 1_000, 10_000)
PARTS_STEPS = int(os.environ.get("BENCH_PARTS_STEPS", 10_000))
WHOLE_STEPS = int(os.environ.get("BENCH_WHOLE_STEPS", 1_000))
WHOLE_ROUNDS = 5
CHECKSUM_ROUNDS = 300
RSS_STEPS = int(os.environ.get("BENCH_RSS_STEPS", 2_000))
ROWS_PER_STEP = 8
MODULES = [f"model.layers.{layer}.{name}" for layer in range(2) for name in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]


def step_rows(step: int) -> list[dict]:
    """One monitored step's rows as the monitor makes them (its columns, random values)."""
    metrics = metric_names()
    return [{"step": step, "micro_batch": 0, "row": i, "sample_index": step * ROWS_PER_STEP + i,
             "loss": random.random(), "loss_kind": "ntp", "num_tokens": 40 + i, "num_response_tokens": 20 + i,
             "num_loss_tokens": 20 + i, "scaled": True, "status": "ok",
             **{f"{m}/{metric}": random.random() for m in MODULES for metric in metrics}}
            for i in range(ROWS_PER_STEP)]


def step_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema([(n, COLUMN_TYPES.get(n, pa.float64())) for n in rows[0]]))


class WholeFile:
    """The baseline, a whole-file writer: every row so far, rewritten whole at each step."""

    def __init__(self, out: Path) -> None:
        self.out, self.table = out, None

    def write(self, rows: list[dict]) -> None:
        table = step_table(rows)
        self.table = table if self.table is None else pa.concat_tables([self.table, table],
                                                                       promote_options="permissive")
        atomic_write(self.out, lambda f: pq.write_table(self.table, f))


def _rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _windows(times: list[float]) -> dict[int, float]:
    """The median of the 10 steps ending at each point reached, in ms."""
    return {p: statistics.median(times[p - 10 : p]) * 1e3 for p in POINTS if p <= len(times)}


def test_write_time_per_step(tmp_path, benchmark):
    """Both writers step by step, each step's two writes one after the other (they share the machine's
    load of the moment), the whole file to WHOLE_STEPS; then the whole file's state at the later points
    built in memory, a write timed WHOLE_ROUNDS times."""
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "m.parquet")
    monitor._start()
    whole = WholeFile(tmp_path / "whole.parquet")
    made = [step_rows(s) for s in range(1, 11)]  # rows made outside the timed writes, reused with their step set
    times: dict[str, list[float]] = {"parts": [], "whole": []}

    def timed(name: str, write, rows) -> None:
        start = time.perf_counter()
        write(rows)
        times[name].append(time.perf_counter() - start)

    def run() -> None:
        for step in range(1, PARTS_STEPS + 1):
            rows = [{**r, "step": step} for r in made[step % 10]]
            timed("parts", monitor._write, rows)
            if step <= WHOLE_STEPS:
                timed("whole", whole.write, rows)
        start = time.perf_counter()
        monitor.close()
        MEDIANS["parts-close"] = time.perf_counter() - start
        for point in [p for p in POINTS if p >= WHOLE_STEPS]:  # the whole file's state at step s, built at once
            built = WholeFile(tmp_path / f"built{point}.parquet")
            before = _rss_mib()
            held = pa.concat_tables([step_table(made[s % 10]) for s in range(1, point)])
            MEDIANS[f"whole-built-{point}-rss"] = _rss_mib() - before
            rounds = []
            for _ in range(WHOLE_ROUNDS):
                built.table = held
                start = time.perf_counter()
                built.write(made[point % 10])
                rounds.append(time.perf_counter() - start)
            MEDIANS[f"whole-built-{point}"] = statistics.median(rounds) * 1e3
            MEDIANS[f"whole-built-{point}-mib"] = built.table.nbytes / 2**20

    benchmark.pedantic(run, rounds=1, iterations=1)
    out = pq.ParquetFile(tmp_path / "m.parquet")
    assert out.metadata.num_rows == PARTS_STEPS * ROWS_PER_STEP
    MEDIANS["parts-file-mib"] = (tmp_path / "m.parquet").stat().st_size / 2**20
    MEDIANS["parts-row-groups"] = out.num_row_groups
    for name, series in times.items():
        MEDIANS[f"{name}-total"] = sum(series)
        for point, ms in _windows(series).items():
            MEDIANS[f"{name}-{point}"] = ms


def test_a_checksummed_part_against_a_plain_one(tmp_path, benchmark):
    """What the checksum beside each part costs (issue 49): one step's part written plainly (atomic_write, as
    before) and with its checksum (write_checksummed, as now), interleaved, CHECKSUM_ROUNDS each."""
    table = step_table(step_rows(1))
    times: dict[str, list[float]] = {"plain": [], "checksummed": []}

    def run() -> None:
        for i in range(CHECKSUM_ROUNDS):
            for name, write in (("plain", atomic_write), ("checksummed", write_checksummed)):
                start = time.perf_counter()
                write(tmp_path / f"{i:08d}.{name}.parquet", lambda f: pq.write_table(table, f))
                times[name].append(time.perf_counter() - start)

    benchmark.pedantic(run, rounds=1, iterations=1)
    for name, series in times.items():
        MEDIANS[f"part-{name}"] = statistics.median(series) * 1e3
    print(f"\none step's part, median of {CHECKSUM_ROUNDS}: plain {MEDIANS['part-plain']:.2f} ms, checksummed "
          f"{MEDIANS['part-checksummed']:.2f} ms ({MEDIANS['part-checksummed'] / MEDIANS['part-plain']:.2f}x)")


RSS = """
import resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from gradspec.training.monitor import SpectralMonitor
from benchmarks.common import peak_rss_mib

steps, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     hidden_size=64, intermediate_size=80)).train()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
monitor = SpectralMonitor(every=1, modules="all", out=out)

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20


start = time.perf_counter()
for step in range(1, steps + 1):
    ids = torch.randint(3, 512, (8, 32))
    with monitor.step(model, step):
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step in (1, 10, 100, 250, 500, 1000, 1500, 2000, steps):
        print("rss", step, round(rss_mib(), 1), round(time.perf_counter() - start, 1), flush=True)
print("steps-peak", round(peak_rss_mib(), 1))
closing = time.perf_counter()
monitor.close()
print("close", round(time.perf_counter() - closing, 2))
print("peak", round(peak_rss_mib(), 1))
"""


def test_rss_of_a_long_monitored_run(tmp_path, benchmark):
    env = {**child_env(OMP_NUM_THREADS="1"), "PYTHONPATH": str(REPO)}  # this checkout's gradspec alone

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", RSS, str(RSS_STEPS), str(tmp_path / "m.parquet")], env=env,
                              capture_output=True, text=True, check=True, timeout=3600)
        return done.stdout

    out = benchmark.pedantic(run, rounds=1, iterations=1)
    for line in out.splitlines():
        kind, *values = line.split()
        if kind == "rss":
            MEDIANS[f"rss-{values[0]}"] = float(values[1])
            MEDIANS[f"rss-{values[0]}-s"] = float(values[2])
        else:
            MEDIANS[f"rss-{kind}"] = float(values[0])
    assert pq.ParquetFile(tmp_path / "m.parquet").metadata.num_rows == RSS_STEPS * ROWS_PER_STEP


def test_report():
    if not {"parts-10", "whole-10", "rss-peak"} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    print("\nwrite per monitored step, ms (median of the 10 steps ending there)")
    print("| step | parts | whole file, run step by step | whole file, state built |")
    for point in POINTS:
        cells = [MEDIANS.get(f"parts-{point}"), MEDIANS.get(f"whole-{point}"), MEDIANS.get(f"whole-built-{point}")]
        print(f"| {point:,} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    print(f"parts: {MEDIANS['parts-total']:.1f} s of writes over {PARTS_STEPS:,} steps; close (compaction) "
          f"{MEDIANS['parts-close']:.1f} s; file {MEDIANS['parts-file-mib']:.1f} MiB in "
          f"{MEDIANS['parts-row-groups']:.0f} row groups")
    print(f"whole file: {MEDIANS['whole-total']:.1f} s of writes over {WHOLE_STEPS:,} steps")
    for point in POINTS:
        if f"whole-built-{point}-mib" in MEDIANS:
            print(f"whole file at step {point:,}: its table holds {MEDIANS[f'whole-built-{point}-mib']:.1f} MiB of "
                  f"rows; building it grew this process's RSS by {MEDIANS[f'whole-built-{point}-rss']:.0f} MiB")
    print(f"RSS over {RSS_STEPS:,} monitored steps, MiB (seconds):")
    print(", ".join(f"step {k[4:]}: {v:.0f} ({MEDIANS[k + '-s']:.0f} s)" for k, v in MEDIANS.items()
                    if k.startswith("rss-") and k[4:].isdigit()))
    print(f"peak over the steps {MEDIANS['rss-steps-peak']:.0f} MiB; with close (compaction) "
          f"{MEDIANS['rss-peak']:.0f} MiB; close {MEDIANS['rss-close']:.1f} s")
