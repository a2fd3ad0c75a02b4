"""Peak memory on the CPU: the forward+backward floor vs gradspec (q/k/v/o, all modules) vs the
reference, on the first 16 HumanEval samples with SmolLM2-135M. Each runs in its own process;
the figure is the peak RSS above the RSS after loading the model and the data (the peak is reset
there through /proc/self/clear_refs, Linux). Run with ``pytest benchmarks/memory/bench_memory.py -s``.

The floor is common.score_floor: forward and input-gradient backward with the engine's own loss
(LM head at response positions only), no hooks. "padded" runs the batches gradspec makes
(token_batches: 4,096 padded tokens, at most 20% padding); "single" one sample per pass.
"""

import subprocess
import sys

import pytest

from benchmarks.common import MEDIANS, child_env

SCRIPT = """
import sys, torch
from benchmarks.common import humaneval_items, padded_batches, reset_peak_rss, score_floor, status_kib
from gradspec.data.readers import humaneval_samples
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.data.models import load_model
from gradspec.engine.reference import reference_scores

mode, batching = sys.argv[1:3]
model, tok = load_model()
model.requires_grad_(False)
items = humaneval_items(tok, list(humaneval_samples(16)))
batches = padded_batches(tok, items, None if batching == "padded" else 0)
before = status_kib("VmRSS")
reset_peak_rss()  # the peak (VmHWM) from the current RSS: loading's own peak does not count
if mode == "floor":
    score_floor(model, batches, "attn")
elif mode == "reference":
    for i in items:
        reference_scores(model, torch.tensor(i.tokens.input_ids), torch.tensor(i.tokens.labels), "attn")
else:
    engine = SpectralEngine(model, mode)
    for b in batches:
        engine.score(*b)
print("peak_above_kib", status_kib("VmHWM") - before)
"""
# (what runs, on which batches); the reference runs one sample at a time whatever the batching
MODES = [("floor", "padded"), ("floor", "single"), ("attn", "padded"), ("attn", "single"), ("all", "padded"),
         ("all", "single"), ("reference", "-")]


@pytest.mark.parametrize("mode,batching", MODES)
def test_peak_memory(mode, batching, benchmark):
    def run():
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode, batching], capture_output=True, text=True,
                              check=True, env=child_env())
        return int(done.stdout.split("peak_above_kib")[1]) / 1024

    MEDIANS[f"memory-{mode}-{batching}"] = benchmark.pedantic(run, rounds=1, iterations=1)


def test_report():
    if not {f"memory-{m}-{b}" for m, b in MODES} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    for m, b in MODES:
        print(f"\n{m} ({b} batches): peak {MEDIANS[f'memory-{m}-{b}']:.0f} MiB above the loaded model and data")
