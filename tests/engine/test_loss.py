"""The shared next-token loss: position t's logits are scored against label t + 1, ignored labels
carry nothing, and the gathered (head-shortcut) form equals the full one to the bit."""

import torch

from gradspec.data.templates import IGNORE_INDEX
from gradspec.engine.loss import next_token_nll, next_token_positions, response_loss_per_sample


def test_positions_are_shifted_by_one():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 7, 8], [IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]])
    rows, cols, targets = next_token_positions(labels)
    assert rows.tolist() == [0, 0, 1] and cols.tolist() == [1, 2, 0] and targets.tolist() == [7, 8, 5]
    keep = torch.tensor([[True, False, False], [False, False, False]])
    assert [t.tolist() for t in next_token_positions(labels, keep)] == [[0], [0], [IGNORE_INDEX]]


def test_gathered_and_full_losses_agree():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11, dtype=torch.bfloat16)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 7, 8], [IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]])
    rows, cols, targets = next_token_positions(labels)
    nll = next_token_nll(logits[:, :-1][rows, cols], targets)
    assert nll.dtype == torch.float32
    by_hand = -torch.log_softmax(logits[0, 1].float(), -1)[7]
    assert torch.equal(nll[0], by_hand)
    loss, count = response_loss_per_sample(logits, labels)
    assert count.tolist() == [2, 1]
    assert torch.equal(loss, torch.stack([nll[:2].sum() / 2, nll[2]]))
    torch.testing.assert_close(next_token_nll(logits[:, :-1][rows, cols], targets, reduction="mean"), nll.mean())
