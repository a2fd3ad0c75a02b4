import itertools

import pytest
import torch
from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model

from gradspec import spectral
from gradspec.dispatch import Fastest, size_bucket
from gradspec.engine import SpectralEngine


def test_size_bucket_rounds_up_to_a_power_of_two():
    assert [size_bucket(n) for n in (1, 2, 3, 32, 33, 100, 128, 129)] == [1, 2, 4, 32, 64, 128, 128, 256]


def test_fastest_measures_each_candidate_once_then_runs_the_winner():
    ticks = itertools.count()
    calls = {"slow": 0, "quick": 0}

    def candidate(name, cost):
        def run():
            calls[name] += 1
            for _ in range(cost):  # each tick of the fake clock is one unit of work
                next(ticks)
            return name
        return run

    fastest = Fastest(clock=lambda: next(ticks))
    candidates = {"slow": candidate("slow", 5), "quick": candidate("quick", 2)}
    assert fastest.choice("k") is None
    assert fastest.run("k", candidates) == "quick"  # the winner's result, not the last one run
    assert calls == {"slow": 2, "quick": 2}  # a warm-up and a timed run each
    assert fastest.choice("k") == "quick" and fastest.seconds["k"]["slow"] > fastest.seconds["k"]["quick"]
    assert fastest.run("k", candidates) == "quick" and calls == {"slow": 2, "quick": 3}
    assert fastest.run("other", {"slow": candidate("slow", 1), "quick": candidate("quick", 9)}) == "slow"


@pytest.fixture
def measured_on_cpu(monkeypatch):
    """Take the GPU's measured dispatch on CPU tensors (the Triton Gram under the interpreter)."""
    monkeypatch.setattr(spectral, "_on_gpu", lambda t: True)
    monkeypatch.setattr(spectral, "DISPATCH", Fastest())
    return spectral


@pytest.mark.skipif(not spectral.HAS_EXTENSION, reason="no _C")
def test_measured_dispatch_matches_the_reference(measured_on_cpu):
    """Every stage measured on its first batch, whichever wins, the scores stay exact; and once a
    stage is measured, the engine keeps the Grams of torch-won stages where they are."""
    model = tiny_model("llama", vocab=500)
    seqs = random_sequences([5, 17, 40, 90], 500)
    engine = SpectralEngine(model, "all")
    assert_matches_reference(model, engine.score(*padded_batch(seqs)), seqs, "all")
    stages = {key[0] for key in measured_on_cpu.DISPATCH.chosen}
    assert {"segment_gram", "core", "gram"} <= stages
    for key, seconds in measured_on_cpu.DISPATCH.seconds.items():
        assert set(seconds) == ({"triton", "torch"} if key[0] == "segment_gram" else {"cpp", "torch"})
    # now the winners alone, with the eigen stage on submit's worker thread as `gradspec score` runs it
    assert_matches_reference(model, engine.submit(*padded_batch(seqs)).result(), seqs, "all")
    for (stage, *size), won in measured_on_cpu.DISPATCH.chosen.items():
        if stage != "segment_gram":
            grams = torch.zeros(1, size[0], size[0])
            assert spectral.eigen_on_host(grams, "auto", stage) == (won == "cpp")
    grams = torch.zeros(1, 4, 4)
    assert spectral.eigen_on_host(grams, "cpp", "core") and not spectral.eigen_on_host(grams, "torch", "core")


def test_measured_lowrank_sketch_matches_the_cpu_path(measured_on_cpu, monkeypatch):
    """The sketch's products through the measured path (Triton's fp32 accumulation or torch) give
    the CPU path's fp64 answer to fp32 accuracy; the rank covers these short gradients exactly."""
    model = tiny_model("llama", vocab=500)
    batch = padded_batch(random_sequences([5, 4], 500))
    measured = SpectralEngine(model, "attn", method="lowrank", rank=8).score(*batch)
    assert any(key[0] == "segment_tdot" for key in measured_on_cpu.DISPATCH.chosen)
    monkeypatch.setattr(spectral, "_on_gpu", lambda t: False)  # the plain CPU path
    plain = SpectralEngine(model, "attn", method="lowrank", rank=8).score(*batch)
    for name, values in plain.metrics.items():
        torch.testing.assert_close(measured.metrics[name], values, rtol=1e-4, atol=1e-9)
