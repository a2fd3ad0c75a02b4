"""Peak memory on the CPU: the forward+backward floor vs gradspec (q/k/v/o, all modules) vs the
reference, on the 16 HumanEval samples of bench_score.py with SmolLM2-135M. Each runs in its own
process; the figure is the peak RSS above the RSS after loading the model and the data (the peak
is reset there through /proc/self/clear_refs, Linux). Run with
``pytest benchmarks/bench_memory.py -s``.
"""

import subprocess
import sys

import pytest
from conftest import MEDIANS

SCRIPT = """
import sys, torch
from gradspec.batching import BATCH_TOKENS, Item, pad_batch, token_batches
from gradspec.data import humaneval_samples
from gradspec.engine import SpectralEngine, response_loss_per_sample
from gradspec.models import load_model
from gradspec.reference import reference_scores
from gradspec.templates import tokenize

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

mode = sys.argv[1]
model, tok = load_model()
model.requires_grad_(False)
items = [Item(s, tokenize(s.messages, tok, "plain", 2048)) for s in humaneval_samples(16)]
batches = [pad_batch([i.tokens for i in b], tok.pad_token_id, "cpu") for b in token_batches(items, BATCH_TOKENS)]
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS: loading's own peak does not count
if mode == "floor":
    for ids, mask, labels in batches:
        embeds = model.get_input_embeddings()(ids).requires_grad_(True)
        logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
        response_loss_per_sample(logits, labels)[0].sum().backward()
elif mode == "reference":
    for i in items:
        reference_scores(model, torch.tensor(i.tokens.input_ids), torch.tensor(i.tokens.labels), "attn")
else:
    engine = SpectralEngine(model, mode)
    for b in batches:
        engine.score(*b)
print("peak_above_kib", status_kib("VmHWM") - before)
"""
MODES = ("floor", "attn", "all", "reference")


@pytest.mark.parametrize("mode", MODES)
def test_peak_memory(mode, benchmark):
    def run():
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(done.stdout.split("peak_above_kib")[1]) / 1024

    MEDIANS[f"memory-{mode}"] = benchmark.pedantic(run, rounds=1, iterations=1)


def test_report():
    if not {f"memory-{m}" for m in MODES} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    for m in MODES:
        print(f"\n{m}: peak {MEDIANS[f'memory-{m}']:.0f} MiB above the loaded model and data")
