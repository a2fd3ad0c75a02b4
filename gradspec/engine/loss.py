"""The model's loss on a sample's labelled tokens: the shifted next-token cross-entropy, with the
LM head applied at labelled positions only where that gives the model's own logits.

Position t of the logits predicts token t + 1, so logits[:, :-1] are scored against labels[:, 1:];
IGNORE_INDEX (data.templates, where labels are made) marks tokens that carry no loss (prompt,
padding). The engine's, the reference's, WIT's and SFTMix's losses all take their cross-entropy
from next_token_nll, and select their positions (as the diagnosis does) with next_token_positions:
one definition of the shift. item_losses gives each item's loss from forward passes alone (the
classic scores, the dynamics).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, pad_id_of, token_batches
from gradspec.data.templates import IGNORE_INDEX
from gradspec.linalg.host_copies import to_device

log = logging.getLogger("gradspec")


def next_token_positions(
    labels: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, targets): the positions (rows, cols) of logits[:, :-1] whose next token is
    kept, and those tokens labels[rows, cols + 1]. keep (N, T - 1) defaults to the labelled next
    tokens; selecting positions first lets a caller run the LM head at those positions alone."""
    target = labels[:, 1:]
    rows, cols = torch.nonzero(target != IGNORE_INDEX if keep is None else keep, as_tuple=True)
    return rows, cols, target[rows, cols]


def next_token_nll(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Cross-entropy of next-token logits (M, V) against their targets (M,), in fp32 whatever the
    model's dtype (a bf16 log-softmax loses the low bits of the loss); IGNORE_INDEX targets give 0."""
    return nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def response_loss_per_sample(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over each sample's labelled tokens -> (loss (N,), count (N,)),
    from the full logits: the reference's loss, which the head shortcut is checked against."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    tok = next_token_nll(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1)).view(
        shift_labels.shape)
    count = (shift_labels != IGNORE_INDEX).sum(1)
    return tok.sum(1) / count.clamp_min(1), count


# Per model: whether its logits are its output embeddings applied to its base model's last hidden
# state, as the head shortcut assumes (checked once, on the first batch it scores).
_HEAD_SHORTCUT: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _shortcut_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows, cols):
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[to_device(rows, hidden.device), to_device(cols, hidden.device)])


def _full_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows, cols):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return logits[to_device(rows, logits.device), to_device(cols, logits.device)]


@torch.no_grad()
def check_head_shortcut(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> bool:
    """Whether the LM head may be applied at labelled positions alone for this model: its output
    embeddings on the base model's hidden states must give the model's own logits. Models that
    transform their logits (soft-capping, scaling under any name, e.g. Granite's
    ``logits_scaling``) fail the check, with a warning, and take the full path. Checked once per
    model, on the first sample of a batch that has labelled tokens; call it outside any hooks."""
    if model in _HEAD_SHORTCUT:
        return _HEAD_SHORTCUT[model]
    if model.get_output_embeddings() is None or not hasattr(model, "base_model"):
        _HEAD_SHORTCUT[model] = False
        return False
    labelled = torch.nonzero((labels[:, 1:] != IGNORE_INDEX).any(1)).flatten()
    if len(labelled) == 0:
        return True  # nothing to compare on yet: no logits are needed for this batch either
    i = labelled[:1]
    ids, mask = input_ids[i], attention_mask[i]
    rows, cols, _ = next_token_positions(labels[i])
    full = _full_logits(model, ids, mask, rows, cols).float()
    short = _shortcut_logits(model, ids, mask, rows, cols).float().to(full.device)
    tol = max(1e-4, 16 * torch.finfo(model.get_output_embeddings().weight.dtype).eps)
    ok = bool((short - full).abs().max() <= tol * full.abs().max().clamp_min(1e-30))
    if not ok:
        log.warning("%s's logits are not its output embeddings of its hidden states (scaled or capped logits): "
                    "the LM head runs at every position", type(model).__name__)
    _HEAD_SHORTCUT[model] = ok
    return ok


def response_losses(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
    token_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample mean response loss and labelled-token count, with the LM head applied at
    labelled positions only; with token_stats also the mean predictive entropy, the
    teacher-forced token accuracy and the mean probability of the target token over those positions.

    Prompt positions need no logits: skipping them saves the head's forward and backward
    there. A model whose logits are more than its head of its hidden states takes the full
    path (check_head_shortcut). loss and the stats lie on the logits' device (a dispatched model's
    head's), count where labels lie: labels on the host select the positions without waiting for the device.
    """
    rows, cols, wanted = next_token_positions(labels)  # where labels lie: on the host, nothing waits
    count = torch.bincount(rows, minlength=len(labels))
    logits = (_shortcut_logits if check_head_shortcut(model, input_ids, attention_mask, labels) else _full_logits)(
        model, input_ids, attention_mask, rows, cols).float()
    rows, wanted, on_logits = (to_device(t, logits.device) for t in (rows, wanted, count))

    def per_sample(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(labels), dtype=values.dtype, device=values.device).index_add(0, rows, values) / (
            on_logits.clamp_min(1))

    loss = per_sample(next_token_nll(logits, wanted))
    stats: dict[str, torch.Tensor] = {}
    if token_stats:
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            stats["mean_entropy"] = per_sample(-(logp.exp() * logp).sum(-1)).double()
            stats["token_accuracy"] = per_sample((logits.argmax(-1) == wanted).float()).double()
            target_logp = logp.gather(1, wanted[:, None]).squeeze(1)
            stats["mean_token_prob"] = per_sample(target_logp.exp()).double()
    return loss, count, stats


@torch.no_grad()
def item_losses(
    model: torch.nn.Module, tokenizer, items: list[Item], batch_tokens: int = BATCH_TOKENS, token_stats: bool = False
) -> Iterator[tuple[Item, float, dict[str, float]]]:
    """(item, mean loss over its labelled tokens, token stats) per item, from forward passes alone
    (the loss is NaN where nothing is labelled)."""
    device = next(model.parameters()).device
    pad_id = pad_id_of(tokenizer)
    for batch in token_batches(items, batch_tokens):
        loss, count, stats = response_losses(model, *pad_batch([b.tokens for b in batch], pad_id, device),
                                             token_stats=token_stats)
        loss, count, stats = loss.cpu(), count.cpu(), {name: column.cpu() for name, column in stats.items()}
        for k, item in enumerate(batch):
            value = float(loss[k]) if count[k] > 0 else math.nan
            yield item, value, {name: float(column[k]) for name, column in stats.items()}
