"""The memory model that sizes score's batches (gradspec.engine.batch_memory) against the measured peak.

SmolLM2-135M on the CPU; per batch shape (rows x T tokens, random tokens, the second half of each
row its response), in its own process: the model's planned bytes, and the peak RSS above the RSS
after loading and the probes (reset through /proc/self/clear_refs, Linux) while two such batches
run as score runs them (submit, the first's eigen stage on the worker beside the second's pass).
Run with ``pytest benchmarks/memory/bench_batch_memory.py -s``; about 4 minutes on 2 cores.
"""

import subprocess
import sys

import pytest

from benchmarks.common import MEDIANS, child_env

SCRIPT = """
import sys, torch
from gradspec.data.models import load_model
from gradspec.engine import batch_memory
from gradspec.engine.spectral_engine import SpectralEngine
from benchmarks.common import reset_peak_rss, status_kib

modules, rows, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tok = load_model(progress=False)
engine = SpectralEngine(model, modules)
memory = batch_memory.measure(engine, tok.pad_token_id)
ids = torch.randint(1000, 20000, (rows, T))
mask = torch.ones_like(ids)
labels = ids.clone()
labels[:, : T // 2] = -100
before = status_kib("VmRSS")
reset_peak_rss()
with engine:
    futures = [engine.submit(ids, mask, labels) for _ in range(2)]
    [f.result() for f in futures]
print("result", memory.bytes(rows, T) / 2**20, (status_kib("VmHWM") - before) / 1024)
"""
SHAPES = [("attn", 8, 512), ("attn", 16, 256), ("attn", 2, 2048), ("all", 8, 512), ("all", 1, 2048)]


@pytest.mark.parametrize("modules,rows,T", SHAPES)
def test_planned_against_measured(modules, rows, T, benchmark):
    def run():
        done = subprocess.run([sys.executable, "-c", SCRIPT, modules, str(rows), str(T)], capture_output=True,
                              text=True, check=True, env=child_env())
        planned, peak = map(float, done.stdout.split("result")[1].split())
        return planned, peak

    MEDIANS[f"batch-memory-{modules}-{rows}-{T}"] = benchmark.pedantic(run, rounds=1, iterations=1)


def test_report():
    if not {f"batch-memory-{m}-{r}-{t}" for m, r, t in SHAPES} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    print("\n| modules | batch | planned (MiB) | measured peak above the model (MiB) | planned / measured |")
    print("| --- | --- | ---: | ---: | ---: |")
    for m, r, t in SHAPES:
        planned, peak = MEDIANS[f"batch-memory-{m}-{r}-{t}"]
        print(f"| {m} | {r} x {t} | {planned:,.0f} | {peak:,.0f} | {planned / peak:.2f} |")
