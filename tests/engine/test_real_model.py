"""SmolLM2-135M-Instruct, real weights: the fast path equals the full-SVD reference."""

import pytest
import torch
from conftest import assert_matches_reference, padded_batch

from gradspec.data.readers import humaneval_samples
from gradspec.data.templates import tokenize
from gradspec.engine.spectral_engine import SpectralEngine


@pytest.mark.parametrize("template", ["plain", "chat"])
def test_smollm2_attention_matches_reference(smol, template):
    model, tok = smol
    # HumanEval 2 and 4 are shorter than 192 tokens (k/v via the T x T core), 1 is longer (via G).
    samples = [s for s in humaneval_samples(5) if s.index in (1, 2, 4)]
    seqs = []
    for s in samples:
        t = tokenize(s.messages, tok, template, 2048)
        seqs.append((torch.tensor(t.input_ids), torch.tensor(t.labels)))
    lengths = [len(x) for x, _ in seqs]
    assert min(lengths) < 192 < max(lengths)
    scores = SpectralEngine(model, "attn").score(*padded_batch(seqs, tok.pad_token_id))
    assert_matches_reference(model, scores, seqs, "attn")


def test_smollm2_mlp_matches_reference(smol):
    model, tok = smol
    modules = "*.layers.0.mlp.*,*.layers.29.mlp.*"
    seqs = []
    for s in humaneval_samples(2):
        t = tokenize(s.messages, tok, "plain", 2048)
        seqs.append((torch.tensor(t.input_ids), torch.tensor(t.labels)))
    scores = SpectralEngine(model, modules).score(*padded_batch(seqs, tok.pad_token_id))
    assert len(scores.metrics) == 6
    assert_matches_reference(model, scores, seqs, modules)
