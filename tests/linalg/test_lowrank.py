import pytest
import torch
from conftest import padded_batch, random_sequences, tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg.lowrank import LOWRANK_METRICS
from gradspec.linalg.metrics import METRICS

VOCAB = 500


def _column(name):
    return LOWRANK_METRICS.index(name)


def test_lowrank_is_exact_when_the_rank_covers_the_gradient():
    """Five tokens give a gradient of rank <= 5: a rank-8 sketch recovers its whole spectrum."""
    model = tiny_model("llama", vocab=VOCAB)
    batch = padded_batch(random_sequences([5, 4], VOCAB))
    exact = SpectralEngine(model, "all").score(*batch)
    approx = SpectralEngine(model, "all", method="lowrank", rank=8).score(*batch)
    for name, values in exact.metrics.items():
        torch.testing.assert_close(approx.metrics[name][:, : len(METRICS)], values, rtol=1e-6, atol=1e-12)
        energy = approx.metrics[name][:, _column("topk_energy")]
        torch.testing.assert_close(energy, torch.ones(2, dtype=torch.float64), rtol=1e-9, atol=0)


def test_lowrank_top_values_close_and_bulk_biased_low():
    model = tiny_model("llama", vocab=VOCAB)
    batch = padded_batch(random_sequences([60, 45], VOCAB))
    exact = SpectralEngine(model, "all").score(*batch)
    approx = SpectralEngine(model, "all", method="lowrank", rank=4, power_iters=3).score(*batch)
    for name, values in exact.metrics.items():
        a = approx.metrics[name]
        for metric in ("spectral_norm", "frobenius_norm", "stable_rank"):
            j = METRICS.index(metric)
            torch.testing.assert_close(a[:, j], values[:, j], rtol=2e-2, atol=0)
        assert (a[:, _column("nuclear_norm")] <= values[:, METRICS.index("nuclear_norm")] * (1 + 1e-9)).all()
        assert (a[:, _column("effective_rank")] <= 4 + 1e-9).all()
        energy = a[:, _column("topk_energy")]
        assert ((energy > 0) & (energy <= 1 + 1e-9)).all()


def test_lowrank_is_seeded_and_independent_of_batch_mates():
    model = tiny_model("qwen2", vocab=VOCAB)
    seqs = random_sequences([30, 50, 12], VOCAB, seed=2)
    together = SpectralEngine(model, "attn", method="lowrank", rank=4, seed=7).score(*padded_batch(seqs))
    again = SpectralEngine(model, "attn", method="lowrank", rank=4, seed=7)
    alone = again.score(*padded_batch(seqs[1:2]))
    other_seed = SpectralEngine(model, "attn", method="lowrank", rank=4, seed=8).score(*padded_batch(seqs))
    name = "model.layers.1.self_attn.q_proj"
    torch.testing.assert_close(alone.metrics[name][0], together.metrics[name][1], rtol=1e-6, atol=0)
    assert not torch.equal(other_seed.metrics[name], together.metrics[name])


def test_bad_method_and_rank():
    model = tiny_model("llama", vocab=VOCAB)
    with pytest.raises(ValueError, match="method"):
        SpectralEngine(model, method="svd")
    with pytest.raises(ValueError, match="rank"):
        SpectralEngine(model, method="lowrank", rank=0)


def test_sketch_values_below_the_cut_off_are_zero_as_on_the_exact_path():
    """A gradient of lower rank than the sketch (a short sample): its Gram's rounding (about 1e-16 of the
    top eigenvalue, so 1e-8 of the top singular value) must read as zero, not as tiny singular values."""
    from gradspec.linalg.lowrank import sketch_singular_values

    g = torch.Generator().manual_seed(3)
    P = torch.randn(4, 6, 2, generator=g, dtype=torch.float64) @ torch.randn(4, 2, 40, generator=g,
                                                                              dtype=torch.float64)
    sigma = sketch_singular_values(P @ P.mT, 5, torch.finfo(torch.float64).eps, 40)
    want = torch.linalg.svdvals(P)[:, :5]
    assert torch.equal(sigma[:, 2:], torch.zeros(4, 3))
    torch.testing.assert_close(sigma[:, :2], want[:, :2], rtol=1e-12, atol=0)
