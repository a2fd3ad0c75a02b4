"""What an objectives retrain of `gradspec validate --objectives` costs against the NTP retrain beside it:
SmolLM2-135M-Instruct (fp32), a pool of 8 HumanEval rows and 4 others as the target, --max-length 256,
batch 4 (2 steps a retrain), AdamW at 1e-4. Each row is one retrain of the whole pool from the same start
(Retrainer: the weights put back, the training loop, every target's loss); WIT and SFTMix compute the
logits at every position where NTP computes them at the response's alone, and SFTMix mixes hidden states
too. SFTMix's one-off measurement of the pool's perplexity (before any retrain) is timed apart. Rounds
alternate between the rows; each row's wall and CPU time (steadier on a shared machine) and its ratio to
NTP's are printed. Run with ``pytest benchmarks/training/bench_objectives.py -s``; BENCH_ROUNDS (default
2) sets the rounds.
"""

import os
import time

from benchmarks.common import interleaved_rounds
from gradspec.data.batching import Item
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.data.templates import tokenize
from gradspec.validation.objective_losses import WIT, SFTMix
from gradspec.validation.retrain import Recipe, Retrainer

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 2))
POOL, TARGETS, MAX_LENGTH, LR = 8, 4, 256, 1e-4


def test_objectives_cost():
    model, tokenizer = load_model()
    samples = list(humaneval_samples(POOL + TARGETS))
    rows = {s.index: tokenize(s.messages, tokenizer, "plain", MAX_LENGTH) for s in samples[:POOL]}
    targets = [Item(s, tokenize(s.messages, tokenizer, "plain", MAX_LENGTH)) for s in samples[POOL:]]
    retrainer = Retrainer(model, tokenizer, rows, targets, Recipe(batch_size=4, learning_rate=LR))
    began = time.perf_counter()
    mix = SFTMix.at_start(model, tokenizer, rows)
    print(f"\nSFTMix's confidence (one forward pass over the pool): {time.perf_counter() - began:.2f} s")
    objectives = {"ntp": None, "wit": WIT(0.3, 1.0), "sftmix": mix}
    cpu: dict[str, list[float]] = {name: [] for name in objectives}

    def timed(name):
        def run():
            began = time.process_time()
            retrainer(sorted(rows), 0, objectives[name])
            cpu[name].append(time.process_time() - began)
        return run

    wall = interleaved_rounds({name: timed(name) for name in objectives}, ROUNDS, "objectives: ")
    for label, table in (("wall", wall), ("CPU", cpu)):
        best = {name: min(t) for name, t in table.items()}
        print(f"\n{label} (best of {ROUNDS}): " + ", ".join(
            f"{name} {best[name]:.2f} s ({best[name] / best['ntp']:.2f}x ntp)" for name in objectives))
