"""The LM-head shortcut (logits at labelled positions only) is used only where it gives the
model's own logits: checked once per model, with a warning and the full path otherwise."""

import logging

import pytest
import torch
from conftest import padded_batch, random_sequences, tiny_model

from gradspec.engine.loss import check_head_shortcut, response_loss_per_sample, response_losses
from gradspec.engine.spectral_engine import SpectralEngine

VOCAB = 500


def granite(scaling: float):
    """A tiny Granite: its logits are the head's divided by config.logits_scaling."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           hidden_size=64, intermediate_size=80, logits_scaling=scaling)
    return GraniteForCausalLM(config).eval()


def _full_loss(model, ids, mask, labels):
    with torch.no_grad():
        return response_loss_per_sample(model(input_ids=ids, attention_mask=mask).logits, labels)[0]


@pytest.mark.parametrize("kind", ["granite", "llama"])
def test_the_loss_is_the_models_own(kind, caplog):
    model = granite(8.0) if kind == "granite" else tiny_model("llama", vocab=VOCAB)
    batch = padded_batch(random_sequences([12, 20], VOCAB))
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        with torch.no_grad():
            loss, _, _ = response_losses(model, *batch)
    torch.testing.assert_close(loss, _full_loss(model, *batch), rtol=1e-5, atol=1e-6)
    assert check_head_shortcut(model, *batch) == (kind == "llama")
    assert ("logits are not its output embeddings" in caplog.text) == (kind == "granite")


def test_the_engine_scores_a_scaled_model_from_its_own_loss():
    """A logits scale of 8 shrinks every gradient 8-fold: the scores must see it."""
    batch = padded_batch(random_sequences([12, 20], VOCAB))
    scaled = SpectralEngine(granite(8.0), "attn").score(*batch)
    plain = SpectralEngine(granite(1.0), "attn").score(*batch)
    torch.testing.assert_close(scaled.loss, _full_loss(granite(8.0), *batch).double(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(scaled.loss, plain.loss)
