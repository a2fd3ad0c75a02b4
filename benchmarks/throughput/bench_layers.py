"""Scoring a few layers costs a forward and a part of the backward: the last 2 of SmolLM2-135M's 30
layers against all 30 (q/k/v/o), CPU.

The engine starts the backward's graph at the scored modules' outputs (``start_graph``), so it runs
from the loss down to the lowest scored module and stops there. Rows, on the same padded batches
(HumanEval 0-15, token_batches, 4,096 tokens): the floor (common.score_floor: forward and input-gradient
backward with the engine's loss, no captures) and ``SpectralEngine.score``, for each layer set.
The last layers' metrics must equal those of the run over all layers. One more row runs the
last 2 layers as the engine did before, with the backward down to the embeddings. Every row gets ROUNDS rounds,
each round starting at another row; medians and ratios are printed. Run with
``pytest benchmarks/throughput/bench_layers.py -s``.
"""

import statistics

import pytest
import torch

from benchmarks.common import humaneval_batches, interleaved_rounds, score_floor
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.engine.spectral_engine import SpectralEngine

ROUNDS = 3


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model()
    model.requires_grad_(False)
    return model, humaneval_batches(tok, list(humaneval_samples(16)))


def test_last_layers_vs_all(setup):
    model, batches = setup
    layers = model.config.num_hidden_layers
    subsets = {"all 30 layers": "attn",
               "last 2 layers": ",".join(f"*.{i}.self_attn.*" for i in range(layers - 2, layers))}
    engines = {name: SpectralEngine(model, modules) for name, modules in subsets.items()}
    last, every = engines["last 2 layers"].score(*batches[0]), engines["all 30 layers"].score(*batches[0])
    for name, values in last.metrics.items():
        assert torch.equal(values, every.metrics[name]), name  # the same numbers, whatever the layer set
    rows = {}
    for name, modules in subsets.items():
        rows[f"floor, {name}"] = lambda m=modules: score_floor(model, batches, m)
        rows[f"engine, {name}"] = lambda e=engines[name]: [e.score(*b) for b in batches]

    def to_the_embeddings() -> None:  # as before start_graph: the embeddings' output required grad
        hook = model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True))
        try:
            [engines["last 2 layers"].score(*b) for b in batches]
        finally:
            hook.remove()

    rows["engine, last 2 layers, backward to the embeddings (before)"] = to_the_embeddings
    for row in rows.values():
        row()  # warm-up, not timed
    times = interleaved_rounds(rows, ROUNDS)
    med = {row: statistics.median(t) for row, t in times.items()}
    base = med["engine, all 30 layers"]
    print(f"\n16 samples ({sum(int(b[1].sum()) for b in batches)} tokens), median of {ROUNDS} rounds")
    for row, m in med.items():
        print(f"  {row:58s} {m:7.2f} s  {m / base:5.2f}x engine on all layers  "
              f"{m / med['floor, all 30 layers']:5.2f}x the floor on all layers  "
              f"(rounds: {', '.join(f'{t:.2f}' for t in times[row])})")
