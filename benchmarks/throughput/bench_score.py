"""gradspec vs the forward+backward floor and vs the full-SVD reference, on SmolLM2-135M.

q/k/v/o of all 30 layers, this machine's CPU, two sets of HumanEval samples: the first 16 and
problems 30-47. Rows, per set:

- floor, padded batches of 1,024 and of 4,096 tokens: the batches gradspec makes (token_batches, at
  most 20% padding; 1,024 is score's default on the CPU, 4,096 on a GPU), one forward and one
  input-gradient backward each, no hooks, with the LM head at response positions only
  (``gradspec.engine.loss.response_losses``, the engine's own loss) and the backward starting at
  the scored modules' outputs, as in the engine (``start_graph``);
- floor, one sample per pass: the same, each sample alone (no padding, attention mask of ones);
- gradspec engine: ``SpectralEngine.score`` on score's CPU batches, one after the other;
- gradspec score: ``gradspec.runs.chunks.score_samples`` as ``gradspec score`` runs it on the CPU
  (tokenization, its padded batches, ``submit`` with one batch in flight, the output rows; no
  model loading, no Parquet);
- the reference (first set only): ``gradspec.engine.reference`` one sample at a time, parameter
  gradients and a full SVD per module.

Every row gets ROUNDS rounds over the whole set, after an untimed warm-up of the floors, the engine
and score (whose first call also runs the engine's one-time memory probes, which plan its batches:
that call's time is printed apart); within a round the rows run back to back, each round starting
at another row, so rows compared share the machine's load of the moment. Medians over rounds are
printed with their ratios to the fastest floor. Run with ``pytest benchmarks/throughput/bench_score.py -s``;
ratios are only meaningful within one run (the machine is noisy); about 7 minutes on 2 cores (BENCH_ROUNDS=5: about 11).
"""

import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import pytest
import torch

from benchmarks.common import humaneval_items, interleaved_rounds, padded_batches, score_floor
from gradspec.data.batching import BATCH_TOKENS, CPU_BATCH_TOKENS, Item
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.engine.reference import reference_scores
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.runs.chunks import score_samples

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))  # more for a steadier median on a noisy machine
SETS = {"HumanEval 0-15": slice(0, 16), "HumanEval 30-47": slice(30, 48)}
REFERENCE_SET = "HumanEval 0-15"


def rows_for(model, tok, engine, name: str, items: list[Item]) -> dict[str, Callable[[], object]]:
    """The timed rows on these items."""
    padded = {tokens: padded_batches(tok, items, tokens) for tokens in (CPU_BATCH_TOKENS, BATCH_TOKENS)}
    single = padded_batches(tok, items, 0)
    samples = [i.sample for i in items]
    rows = {
        **{f"floor, {tokens:,}-token batches": partial(score_floor, model, batches)
           for tokens, batches in padded.items()},
        "floor, one sample per pass": lambda: score_floor(model, single),
        "gradspec engine": lambda: [engine.score(*b) for b in padded[CPU_BATCH_TOKENS]],
        "gradspec score": lambda: score_samples(samples, engine, tok, lambda chunk, rows: None,
                                                batch_tokens=CPU_BATCH_TOKENS, progress=False),
    }
    if name == REFERENCE_SET:
        pairs = [(torch.tensor(i.tokens.input_ids), torch.tensor(i.tokens.labels)) for i in items]
        rows["reference"] = lambda: [reference_scores(model, ids, labels, "attn") for ids, labels in pairs]
    return rows


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model()
    model.requires_grad_(False)
    samples = list(humaneval_samples(max(s.stop for s in SETS.values())))
    return model, tok, {name: samples[s] for name, s in SETS.items()}


def test_score_vs_floor_and_reference(setup):
    model, tok, sets = setup
    engine = SpectralEngine(model, "attn")
    for name, samples in sets.items():
        items = humaneval_items(tok, samples)
        rows = rows_for(model, tok, engine, name, items)
        for row in [r for r in rows if r.startswith("floor")] + ["gradspec engine", "gradspec score"]:
            start = time.perf_counter()
            rows[row]()  # the allocator, the OpenMP threads, score's memory probes: not timed
            if row == "gradspec score":
                print(f"\n{name}: score's first call, with the engine's one-time memory probes if not run yet: "
                      f"{time.perf_counter() - start:.2f} s")
        times = interleaved_rounds(rows, ROUNDS, f"{name}, ")
        tokens = [i.tokens.num_tokens for i in items]
        med = {row: statistics.median(t) for row, t in times.items()}
        best_floor = min(m for row, m in med.items() if row.startswith("floor"))
        print(f"\n{name}: {len(samples)} samples, {min(tokens)}-{max(tokens)} tokens ({sum(tokens)} in all), "
              f"median of {ROUNDS} rounds each")
        for row, m in med.items():
            print(f"  {row:30s} {m:7.2f} s  {m / len(samples):6.3f} s/sample  {m / best_floor:5.2f}x the fastest "
                  f"floor  (rounds: {', '.join(f'{t:.2f}' for t in times[row])})")
        if "reference" in med:
            print(f"  reference / gradspec score = {med['reference'] / med['gradspec score']:.1f}x")
