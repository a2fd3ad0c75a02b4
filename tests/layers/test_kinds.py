"""One harness for every registered layer kind: each model family's parts, every kind among them,
against the one-sample reference (autograd of the parameter slice, full SVD), which knows no kind."""

import pytest
import torch
from conftest import MOE_KINDS, assert_matches_reference, padded_batch, random_sequences, tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers import registry

VOCAB = 500
# Lengths on both sides of every part's smaller size (24-64): the core and the materialised path.
LENGTHS = [5, 23, 70]
FAMILIES = ["llama", "qwen2", "phi3", "gpt2", *MOE_KINDS]


@pytest.fixture(scope="module")
def kinds_seen():
    seen: set[str] = set()
    yield seen
    assert seen >= {getattr(k, "__name__", repr(k)) for k in registry.LAYER_KINDS}, "a registered kind is untested"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_matches_the_reference(family, kinds_seen):
    # grouped_mm, the default experts implementation, has no fp64 kernel: MoE models run in fp32
    model = tiny_model(family, vocab=VOCAB)
    model = model if family in MOE_KINDS else model.double()
    engine = SpectralEngine(model, "all")
    kinds_seen.update(t.kind for t in engine.targets)
    seqs = random_sequences(LENGTHS, VOCAB, seed=1)
    scores = engine.score(*padded_batch(seqs))
    routed = {p.name for p in engine.parts if p.routed}
    assert_matches_reference(model, scores, seqs, "all", routed=routed)
    if family in MOE_KINDS:
        assert {t.kind for t in engine.targets} == {"linear", "experts", "router"}
        assert len(routed) == 2 * 4 * 3 and not set(engine.part_names) - routed - {
            p.name for p in engine.parts if p.role in ("q", "k", "v", "o", "router")}


@pytest.mark.parametrize("family", list(MOE_KINDS))
def test_experts_in_fp64_under_the_eager_implementation(family):
    """The reference differentiates whichever implementation the model runs: here transformers' eager
    loop, in fp64, where the agreement is far tighter (the routers' softmax still runs in fp32)."""
    model = tiny_model(family, vocab=VOCAB).double()
    model.set_experts_implementation("eager")
    engine = SpectralEngine(model, "experts,router")
    seqs = random_sequences(LENGTHS, VOCAB, seed=2)
    scores = engine.score(*padded_batch(seqs))
    assert_matches_reference(model, scores, seqs, "experts,router", rtol=1e-6,
                             routed={p.name for p in engine.parts if p.routed})
    assert engine.describe() == {"experts_implementation": {"captured_as": "gradspec", "model": "eager"}}


def test_routed_tokens_count_each_sample_s_own_tokens():
    """Per expert, each sample's tokens within its length sent there; every token reaches top-k experts,
    and padding is not counted."""
    model = tiny_model("qwen3_moe", vocab=VOCAB)
    engine = SpectralEngine(model, "experts")
    seqs = random_sequences(LENGTHS, VOCAB, seed=3)
    scores = engine.score(*padded_batch(seqs))
    layer0 = torch.stack([scores.routed_tokens[f"model.layers.0.mlp.experts.{e}"] for e in range(4)])
    assert layer0.sum(0).tolist() == [2 * n for n in LENGTHS]  # top-2
    for i, seq in enumerate(seqs):  # the same counts alone, unpadded
        alone = engine.score(*padded_batch([seq]))
        assert [int(alone.routed_tokens[f"model.layers.0.mlp.experts.{e}"][0]) for e in range(4)] == \
            layer0[:, i].tolist()


def test_the_model_s_own_forward_is_put_back():
    model = tiny_model("mixtral", vocab=VOCAB)
    experts = model.model.layers[0].mlp.experts
    ids = torch.randint(3, VOCAB, (1, 9))
    before = model(input_ids=ids).logits
    SpectralEngine(model, "all").score(*padded_batch(random_sequences([9], VOCAB)))
    assert "forward" not in experts.__dict__
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
