"""`gradspec align` against `gradspec score` and the floor, on SmolLM2-135M (CPU).

Pool: HumanEval 0-15; task: 20 other HumanEval problems (100-119); q/k/v/o of all 30 layers, fp64.
Rows, on the same padded batches (token_batches, 4,096 tokens):

- floor: forward and input-gradient backward with the engine's loss (bench_score's floor);
- score: ``SpectralEngine.score``, spectra only (what `gradspec score` computes);
- align: ``SpectralEngine.score`` with spectra off and a task of 20 (mean_gradient, mean), each
  module on the route the shape rule picks; then the same forced onto the dense and onto the cross
  route, with ``max`` too (one direction per task example), and with the spectra in the same pass.

Building the task (two passes over its 20 examples) is a one-off per task and model; it is timed
apart. Every row gets ROUNDS rounds, each round starting at another row; medians and their ratios
to the floor and to score are printed. Run with ``pytest benchmarks/bench_align.py -s``.
"""

import statistics
import time

import pytest
from bench_score import floor
from conftest import interleaved_rounds

from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, token_batches
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.data.templates import tokenize
from gradspec.engine.spectral_engine import SpectralEngine

ROUNDS = 3
POOL, TASK = slice(0, 16), slice(100, 120)


def _batches(tok, samples):
    items = [Item(s, tokenize(s.messages, tok, "plain", 2048)) for s in samples]
    return [pad_batch([i.tokens for i in b], tok.pad_token_id, "cpu") for b in token_batches(items, BATCH_TOKENS)]


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model()
    model.requires_grad_(False)
    samples = list(humaneval_samples(TASK.stop))
    return model, tok, _batches(tok, samples[POOL]), _batches(tok, samples[TASK])


def test_align_vs_score_and_floor(setup):
    model, tok, pool, task = setup
    engines = {}
    build = {}
    for name, aggregates, route, spectra in [
        ("align", "mean_gradient,mean", "auto", False),
        ("align, dense route", "mean_gradient,mean", "dense", False),
        ("align, cross route", "mean_gradient,mean", "cross", False),
        ("align with max", "mean_gradient,mean,max", "auto", False),
        ("align + spectra", "mean_gradient,mean", "auto", True),
    ]:
        engine = SpectralEngine(model, "attn", spectra=spectra)
        start = time.perf_counter()
        engine.set_task(task, aggregates, route=route)
        build[name] = time.perf_counter() - start
        engines[name] = engine
    routes = [d.route for d in engines["align"].task.parts.values()]
    score_engine = SpectralEngine(model, "attn")
    rows = {"floor": lambda: floor(model, pool), "score": lambda: [score_engine.score(*b) for b in pool]}
    rows.update({name: (lambda e=e: [e.score(*b) for b in pool]) for name, e in engines.items()})
    for row in ("floor", "score", "align"):
        rows[row]()  # warm-up, not timed
    times = interleaved_rounds(rows, ROUNDS)
    med = {row: statistics.median(t) for row, t in times.items()}
    task_tokens = sum(int(b[1].sum()) for b in task)
    print(f"\npool: 16 samples ({sum(int(b[1].sum()) for b in pool)} tokens); task: 20 examples ({task_tokens} "
          f"tokens); auto routes: {routes.count('dense')} dense, {routes.count('cross')} cross; "
          f"median of {ROUNDS} rounds")
    for row, m in med.items():
        print(f"  {row:20s} {m:7.2f} s  {m / med['floor']:5.2f}x floor  {m / med['score']:5.2f}x score  "
              f"(rounds: {', '.join(f'{t:.2f}' for t in times[row])})"
              + (f"  task built in {build[row]:.2f} s" if row in build else ""))
