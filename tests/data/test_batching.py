"""Scores do not depend on the batching: a sample alone or in a padded batch gets the same numbers."""

from types import SimpleNamespace

import pytest
import torch
from conftest import random_sequences, tiny_model

from gradspec.data import batching
from gradspec.data.readers import Sample
from gradspec.data.templates import Tokenized
from gradspec.engine.loss import item_losses, response_losses
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg.metrics import METRICS

LENGTHS = [12, 30, 9, 30, 17, 25, 9, 40]


def _items(lengths, vocab=64, seed=0):
    return [batching.Item(Sample(i, []), Tokenized(ids.tolist(), labels.tolist(), "ok"))
            for i, (ids, labels) in enumerate(random_sequences(lengths, vocab, seed))]


def _padded(items):
    return batching.pad_batch([i.tokens for i in items], 0, "cpu")


def test_one_sample_per_pass_scores_as_one_padded_batch():
    """In fp64, each sample alone (no padding, attention mask of ones) gets what one padded batch
    of every sample gives, to 1e-9 relative."""
    model = tiny_model("llama", vocab=64).double()
    engine = SpectralEngine(model, "all")
    items = _items(LENGTHS)
    together = engine.score(*_padded(items))
    for i, item in enumerate(items):
        alone = engine.score(*_padded([item]))
        assert alone.status(0) == together.status(i) == "ok"
        assert alone.loss[0].item() == pytest.approx(together.loss[i].item(), rel=1e-9)
        for name in together.metrics:
            torch.testing.assert_close(alone.metrics[name][0], together.metrics[name][i], rtol=1e-9, atol=0,
                                       msg=f"{name}, sample {i}, metrics {METRICS}")


def test_item_losses_match_one_padded_batch():
    model = tiny_model("llama", vocab=64).double()
    items = _items(LENGTHS)
    with torch.no_grad():
        loss, _, stats = response_losses(model, *_padded(items), token_stats=True)
    got = list(item_losses(model, SimpleNamespace(pad_token_id=0), items, token_stats=True))
    assert sorted(item.sample.index for item, _, _ in got) == list(range(len(items)))
    for item, value, row in got:
        i = item.sample.index
        assert value == pytest.approx(loss[i].item(), rel=1e-9)
        assert row == pytest.approx({name: column[i].item() for name, column in stats.items()}, rel=1e-9)
