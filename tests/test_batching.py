"""The CPU's batching policy: no padding, and the same scores as padded batches."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import random_sequences, tiny_model

import gradspec
from gradspec import batching
from gradspec.data import Sample
from gradspec.engine import SpectralEngine, response_losses
from gradspec.metrics import METRICS
from gradspec.templates import Tokenized

LENGTHS = [12, 30, 9, 30, 17, 25, 9, 40]


def _items(lengths, vocab=64, seed=0):
    return [batching.Item(Sample(i, []), Tokenized(ids.tolist(), labels.tolist(), "ok"))
            for i, (ids, labels) in enumerate(random_sequences(lengths, vocab, seed))]


def _padded(items):
    return batching.pad_batch([i.tokens for i in items], 0, "cpu")


def test_cpu_batches_carry_no_padding():
    items = _items(LENGTHS)
    batches = list(batching.device_batches(items, batching.BATCH_TOKENS, "cpu"))
    assert sorted(i.sample.index for b in batches for i in b) == list(range(len(LENGTHS)))
    assert all(len({i.tokens.num_tokens for i in b}) == 1 for b in batches)  # same length: no padding
    assert sorted(len(b) for b in batches) == [1, 1, 1, 1, 2, 2]  # the two 9s and the two 30s share a pass
    assert all(bool(_padded(b)[1].all()) for b in batches)  # attention masks of ones
    small = list(batching.device_batches(items, 30, "cpu"))  # the token budget still holds
    assert all(len(b) * b[0].tokens.num_tokens <= 30 or len(b) == 1 for b in small)


def test_gpu_batches_are_padded_token_batches():
    items = _items(LENGTHS)
    want = [[i.sample.index for i in b] for b in batching.token_batches(items, 100)]
    got = [[i.sample.index for i in b] for b in batching.device_batches(items, 100, torch.device("cuda"))]
    assert got == want and any(len({items[k].tokens.num_tokens for k in b}) > 1 for b in got)


def test_cpu_batches_score_as_one_padded_batch():
    """Per-sample scores do not depend on the batching: in fp64, the CPU's unpadded passes give
    what one padded batch of every sample gives, to 1e-9 relative."""
    model = tiny_model("llama", vocab=64).double()
    engine = SpectralEngine(model, "all")
    items = _items(LENGTHS)
    together = engine.score(*_padded(items))
    for batch in batching.device_batches(items, batching.BATCH_TOKENS, "cpu"):
        alone = engine.score(*_padded(batch))
        for k, item in enumerate(batch):
            i = item.sample.index
            assert alone.status(k) == together.status(i) == "ok"
            assert alone.loss[k].item() == pytest.approx(together.loss[i].item(), rel=1e-9)
            for name in together.metrics:
                torch.testing.assert_close(alone.metrics[name][k], together.metrics[name][i], rtol=1e-9, atol=0,
                                           msg=f"{name}, sample {i}, metrics {METRICS}")


def test_item_losses_match_one_padded_batch():
    model = tiny_model("llama", vocab=64).double()
    items = _items(LENGTHS)
    with torch.no_grad():
        loss, _, stats = response_losses(model, *_padded(items), token_stats=True)
    got = list(batching.item_losses(model, SimpleNamespace(pad_token_id=0), items, token_stats=True))
    assert sorted(item.sample.index for item, _, _ in got) == list(range(len(items)))
    for item, value, row in got:
        i = item.sample.index
        assert value == pytest.approx(loss[i].item(), rel=1e-9)
        assert row == pytest.approx({name: column[i].item() for name, column in stats.items()}, rel=1e-9)


def test_score_runs_unpadded_passes_on_the_cpu(tmp_path, tiny_model_dir, monkeypatch):
    """gradspec score on the CPU: every pass it makes has an attention mask of ones."""
    masks = []
    real_submit = gradspec.SpectralEngine.submit

    def submit(self, input_ids, attention_mask, labels):
        masks.append(attention_mask.clone())
        return real_submit(self, input_ids, attention_mask, labels)

    monkeypatch.setattr(gradspec.SpectralEngine, "submit", submit)
    rows = [{"instruction": "word " * n, "output": "reply " * (n % 3 + 1)} for n in (1, 5, 2, 9, 5)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    assert df["loss"].notna().all() and len(masks) == 4  # all scored; the two rows of one length share a pass
    assert all(bool(m.all()) for m in masks)
