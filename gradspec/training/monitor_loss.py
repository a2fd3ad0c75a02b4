"""Which loss a monitored row is the gradient of, and its value.

The step backpropagates L = sum_i l_i / N, where l_i is sample i's summed (weighted) token loss and N
the loss's denominator, so each hooked module sees, per sample, the output gradient of l_i / N. The
monitor multiplies it by N / n_i (``loss_scale``), n_i the sample's own denominator: a row holds the
spectrum of d(l_i / n_i)/dW, the gradient of the loss of sample i trained alone, whichever batch,
accumulation split or number of processes it came in. Its ``loss_kind`` says which loss, and ``loss``
is that loss's value, l_i / n_i (``sample_losses``):

- ``ntp``, the model's own causal-LM loss: l_i = sum of the cross-entropy over its labelled
  (response) tokens, n_i their count (``num_loss_tokens``): the gradient of the sample's mean
  response loss, so rows equal ``gradspec score`` on the same batch and weights, ``loss`` included.
- ``wit(lp=..,lr=..)``, WIT installed with ``use_wit_loss``: l_i = lp * sum over its prompt
  tokens + lr * sum over its response tokens, n_i = 1[lp != 0] |P_i| + 1[lr != 0] |R_i|.
- ``unknown``: the loop computes the loss itself (SFTMix, a ``compute_loss_func``, labels kept out
  of the model call), or the model's loss function is neither of the above: rows hold each
  sample's share of the step's gradient as it is (``scaled`` false, ``loss`` null).

N is ``num_items_in_batch`` where the model call gets it (Trainer: the labelled tokens of the whole
accumulated batch, over all processes with ``average_tokens_across_devices``; ``processes`` divides
out the factor Trainer then multiplies the loss by); otherwise the micro-batch's own count times
``accumulation`` (the loop divides a mean loss by its accumulation steps).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from gradspec.engine.loss import next_token_nll
from gradspec.training.wit import WITLoss, next_token_targets

UNKNOWN = "unknown"
LOSS_CHUNK_BYTES = 256 * 2**20  # the fp32 logits a loss computes at once


class SampleLoss(NamedTuple):
    """The loss a micro-batch's rows are the gradients of."""

    kind: str  # the rows' loss_kind
    weights: tuple[float, float] | None  # the model's loss's (prompt, response) token weights
    tokens: torch.Tensor  # n_i where scaled; else every token but the first
    scaled: bool  # whether the rows are of each sample's own loss (else its share of the step's)


def sample_loss(model: nn.Module, loss_known: bool, labels: torch.Tensor | None, lengths: torch.Tensor,
                device: torch.device) -> SampleLoss:
    """The loss of a micro-batch whose samples have these labels (None: no labels in the model call) and
    lengths; loss_known False: the trainer's loss is not the model's."""
    kind, weights = model_loss(model) if loss_known else (UNKNOWN, None)
    scaled = labels is not None and weights is not None
    tokens = loss_tokens(labels, *weights) if scaled else lengths.to(device) - 1
    return SampleLoss(kind if scaled else UNKNOWN, weights, tokens, scaled)


def model_loss(model: nn.Module) -> tuple[str, tuple[float, float] | None]:
    """The loss the model computes when called with labels: its name and its token weights
    (prompt, response); None where the monitor does not know how it weighs tokens."""
    loss_function = getattr(model, "loss_function", None)
    wit = getattr(loss_function, "__self__", None)
    if isinstance(wit, WITLoss):
        return f"wit(lp={wit.prompt_weight:g},lr={wit.response_weight:g})", (wit.prompt_weight, wit.response_weight)
    if loss_function is ForCausalLMLoss:
        return "ntp", (0.0, 1.0)
    return UNKNOWN, None


def loss_tokens(labels: torch.Tensor, prompt_weight: float, response_weight: float) -> torch.Tensor:
    """n_i, each sample's own denominator: its targets whose weight is not zero (WIT's
    1[lp != 0] |P_i| + 1[lr != 0] |R_i|; prompt targets are encoded as -(id + PROMPT_OFFSET))."""
    return (next_token_targets(labels, prompt_weight, response_weight)[1] != 0).sum(1)


def loss_scale(tokens: torch.Tensor, num_items: torch.Tensor | int | None, accumulation: int,
               processes: int) -> torch.Tensor:
    """N / n_i: from each sample's share of the step's loss to the loss of the sample alone."""
    if num_items is None:  # the model's mean over this micro-batch, divided by the accumulation steps
        total = tokens.sum().double() * accumulation
    else:  # over the global batch's tokens, the loss multiplied by the processes (Trainer under DDP)
        total = torch.as_tensor(num_items, device=tokens.device).double() / processes
    return torch.where(tokens > 0, total / tokens.clamp_min(1), 0.0)


def output_losses(output: Any, labels: torch.Tensor, weights: tuple[float, float], owner: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor | None:
    """l_i / n_i per sample from a model call's output: its logits, or a fused head's per-token
    log-probabilities (TRL's, zero off the labels); None where the output has neither in the labels' shape.
    labels: as the model got them, (rows, T); owner: each position's sample; tokens: n_i."""
    logits, log_probs = getattr(output, "logits", None), getattr(output, "log_probs", None)
    with torch.no_grad():
        if isinstance(logits, torch.Tensor) and logits.shape[:2] == labels.shape:
            return sample_losses(logits.detach(), labels, *weights, owner, tokens)
        if isinstance(log_probs, torch.Tensor) and weights == (0.0, 1.0) and log_probs.shape == labels[:, 1:].shape:
            total = torch.zeros(len(tokens), dtype=torch.float64, device=log_probs.device)
            total.index_add_(0, owner[:, 1:].flatten(), -log_probs.detach().double().flatten())
            return total / tokens.double()
    return None


def sample_losses(logits: torch.Tensor, labels: torch.Tensor, prompt_weight: float, response_weight: float,
                  owner: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """l_i / n_i per sample (NaN where n_i = 0), in fp32, a few rows at a time: no fp32 copy of the whole
    batch's logits, and nothing read on the host. owner (rows, T): the sample each position belongs to
    (a row, or a packed sequence); tokens: n_i."""
    ids, weights = next_token_targets(labels, prompt_weight, response_weight)
    owner = torch.nn.functional.pad(owner[:, 1:], (0, 1))  # each target's sample (the last position: no target)
    total = torch.zeros(len(tokens), device=logits.device)
    rows = max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[1] * logits.shape[2]))
    for start in range(0, len(logits), rows):
        part = slice(start, start + rows)
        nll = next_token_nll(logits[part].flatten(0, 1), ids[part].flatten()) * weights[part].flatten()
        total.index_add_(0, owner[part].flatten(), nll)
    return total.double() / tokens.double()
