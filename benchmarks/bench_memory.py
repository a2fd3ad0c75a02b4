"""Peak memory on the CPU: the forward+backward floor vs gradspec (q/k/v/o, all modules) vs the
reference, on the first 16 HumanEval samples with SmolLM2-135M. Each runs in its own process;
the figure is the peak RSS above the RSS after loading the model and the data (the peak is reset
there through /proc/self/clear_refs, Linux). Run with ``pytest benchmarks/bench_memory.py -s``.

The floor is bench_score.py's: forward and input-gradient backward with the engine's own loss
(LM head at response positions only), no hooks. "padded" runs the batches gradspec makes
(token_batches: 4,096 padded tokens, at most 20% padding); "single" one sample per pass.
"""

import subprocess
import sys

import pytest
from conftest import MEDIANS

SCRIPT = """
import sys, torch
from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, token_batches
from gradspec.data.readers import humaneval_samples
from gradspec.layers.linear import start_graph
from gradspec.engine.loss import response_losses
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.targets import select_targets
from gradspec.data.models import load_model
from gradspec.engine.reference import reference_scores
from gradspec.data.templates import tokenize

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

mode, batching = sys.argv[1:3]
model, tok = load_model()
model.requires_grad_(False)
items = [Item(s, tokenize(s.messages, tok, "plain", 2048)) for s in humaneval_samples(16)]
cut = token_batches(items, BATCH_TOKENS) if batching == "padded" else [[i] for i in items]
batches = [pad_batch([i.tokens for i in b], tok.pad_token_id, "cpu") for b in cut]
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS: loading's own peak does not count
if mode == "floor":
    for target in select_targets(model, "attn"):  # the backward from the loss to the scored modules, as the engine's
        target.module.register_forward_hook(lambda module, args, out: start_graph(out))
    for ids, mask, labels in batches:
        loss, count, _ = response_losses(model, ids, mask, labels)
        loss[count > 0].sum().backward()
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
                              check=True)
        return int(done.stdout.split("peak_above_kib")[1]) / 1024

    MEDIANS[f"memory-{mode}-{batching}"] = benchmark.pedantic(run, rounds=1, iterations=1)


def test_report():
    if not {f"memory-{m}-{b}" for m, b in MODES} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    for m, b in MODES:
        print(f"\n{m} ({b} batches): peak {MEDIANS[f'memory-{m}-{b}']:.0f} MiB above the loaded model and data")
