"""`gradspec align` against `gradspec score` and the floor, on SmolLM2-135M (CPU).

Pool: HumanEval 0-15; task: 20 other HumanEval problems (100-119); q/k/v/o of all 30 layers, fp64.
Rows, on the same padded batches (token_batches, 4,096 tokens):

- floor: forward and input-gradient backward with the engine's loss (common.score_floor);
- score: ``SpectralEngine.score``, spectra only (what `gradspec score` computes);
- align: ``SpectralEngine.score`` with spectra off and a task of 20 (mean_gradient, mean), each
  module on the route the shape rule picks; then the same forced onto the dense and onto the cross
  route, with ``max`` too (one direction per task example), and with the spectra in the same pass.

Building the task (two passes over its 20 examples) is a one-off per task and model; it is timed
apart. Every row gets ROUNDS rounds, each round starting at another row; medians and their ratios
to the floor and to score are printed. Run with ``pytest benchmarks/throughput/bench_align.py -s``.
"""

import statistics
import time

import pytest

from benchmarks.common import humaneval_batches, interleaved_rounds, score_floor
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.engine.spectral_engine import SpectralEngine

ROUNDS = 3
POOL, TASK = slice(0, 16), slice(100, 120)


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model()
    model.requires_grad_(False)
    samples = list(humaneval_samples(TASK.stop))
    return model, tok, humaneval_batches(tok, samples[POOL]), humaneval_batches(tok, samples[TASK])


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
    rows = {"floor": lambda: score_floor(model, pool), "score": lambda: [score_engine.score(*b) for b in pool]}
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
