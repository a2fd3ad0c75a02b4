"""WIT, weighted instruction tuning ("On the Effect of Instruction Tuning Loss on Generalization").

    L = -[sum_i (lp * sum_{prompt tokens of i} log p + lr * sum_{response tokens of i} log p)]
        / sum_i (1[lp != 0] |P_i| + 1[lr != 0] |R_i|)

with the token counts over the whole global batch. (0, 1) is the usual completion-only loss,
(1, 1) continued pre-training; the paper recommends lp in 0-0.5 with lr in 0.5-1.

Prompt and response targets travel in one labels tensor, so the loss fits Trainer's
``compute_loss_func``: response tokens keep their id when lr != 0, prompt tokens with lp != 0
become ``-(id + 101)`` (never the ignore index -100), everything else is -100. Trainer then counts
exactly WIT's denominator as ``num_items_in_batch`` (labels != -100, shifted, summed over
gradient-accumulation steps and devices), which is what keeps the loss exact under both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradspec.choices import MAX_LENGTH
from gradspec.data.batching import pad_batch, pad_id_of
from gradspec.data.readers import Fields, to_sample
from gradspec.data.templates import IGNORE_INDEX, tokenize
from gradspec.engine.loss import next_token_nll
from gradspec.training.sample_index import SAMPLE_INDEX, sample_indices

PROMPT_OFFSET = 101  # prompt token id t is stored as -(t + PROMPT_OFFSET)


def encode_labels(input_ids: torch.Tensor, response_mask: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_weight: float, response_weight: float = 1.0) -> torch.Tensor:
    """WIT labels: response tokens as ids and prompt tokens encoded, each only when they carry
    weight (so that counting labels != -100 gives WIT's denominator), the rest -100."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    real = attention_mask.bool()
    if response_weight != 0:
        labels[real & response_mask] = input_ids[real & response_mask]
    if prompt_weight != 0:
        prompt = real & ~response_mask
        labels[prompt] = -(input_ids[prompt] + PROMPT_OFFSET)
    return labels


def wit_loss(logits: torch.Tensor, labels: torch.Tensor, prompt_weight: float, response_weight: float,
             num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """The WIT loss of a (micro-)batch. num_items: the global batch's denominator (Trainer's
    num_items_in_batch); None counts this batch's own labelled tokens.

    Args:
        logits: (N, T, vocab) the model's logits.
        labels: (N, T) WIT labels (encode_labels, WITCollator): response ids, prompt ids encoded
            as -(id + 101), -100 elsewhere; position t is predicted from t - 1.
        prompt_weight: lp, the weight of each prompt token's loss.
        response_weight: lr, the weight of each response token's loss.
        num_items: The denominator: Trainer's num_items_in_batch (the labels != -100 of the whole
            accumulated batch); None: this batch's own weighted targets.

    Returns:
        A scalar: the weighted sum of the targets' cross-entropies over num_items.
    """
    ids, weights = next_token_targets(labels, prompt_weight, response_weight)
    nll = next_token_nll(logits.flatten(0, 1), ids.flatten())
    if num_items is None:
        num_items = (weights != 0).sum()
    return (weights.flatten().to(nll.dtype) * nll).sum() / num_items


def next_token_targets(labels: torch.Tensor, prompt_weight: float,
                       response_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights), each (N, T): position t's next token (labels[:, t + 1] decoded; -100 where it
    carries no weight, and at the last position) and its weight. Aligned with the logits (N, T, V),
    so that a loss needs neither a slice of them (a copy) nor the positions read on the host.

    Args:
        labels: (N, T) WIT labels (encode_labels).
        prompt_weight: lp.
        response_weight: lr.

    Returns:
        ids (int64) and weights (fp32).
    """
    target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    prompt, response = target <= -PROMPT_OFFSET, target >= 0
    weights = torch.where(prompt, float(prompt_weight), torch.where(response, float(response_weight), 0.0))
    ids = torch.where(prompt, -target - PROMPT_OFFSET, target)
    return torch.where(weights != 0, ids, IGNORE_INDEX), weights


def check_weights(prompt_weight: float, response_weight: float) -> None:
    """WIT's weights are finite, at least 0, and not both 0 (a loss of nothing is 0/0)."""
    for name, value in (("prompt_weight", prompt_weight), ("response_weight", response_weight)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if prompt_weight == 0 and response_weight == 0:
        raise ValueError("prompt_weight and response_weight are both 0: nothing to learn from")


@dataclass
class WITLoss:
    """``compute_loss_func`` for transformers' Trainer and TRL's SFTTrainer (with WITCollator).

    Args:
        prompt_weight: lp, the weight of the prompt tokens' loss (>= 0; 0: completion-only).
        response_weight: lr, the weight of the response tokens' loss (>= 0; not both 0).
    """

    prompt_weight: float = 0.0
    response_weight: float = 1.0

    def __post_init__(self) -> None:
        check_weights(self.prompt_weight, self.response_weight)

    def __call__(self, outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None):
        """The loss of a batch, as Trainer calls a ``compute_loss_func``.

        Args:
            outputs: The model's outputs: a dict with "logits", or a tuple whose first element they are.
            labels: (N, T) WIT labels, as WITCollator makes them.
            num_items_in_batch: Trainer's count of the global batch's labels != -100; None: this
                batch's own.

        Returns:
            The scalar WIT loss (wit_loss).
        """
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return wit_loss(logits, labels, self.prompt_weight, self.response_weight, num_items_in_batch)

    def model_loss(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                   num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any) -> torch.Tensor:
        """The signature of a transformers model's ``loss_function`` (see use_wit_loss).

        Args:
            logits: (N, T, vocab) the model's logits.
            labels: (N, T) WIT labels, as WITCollator makes them.
            vocab_size: Unused (the model passes it).
            num_items_in_batch: Trainer's count of the global batch's labels != -100; None: this
                batch's own.
            **kwargs: What else the model passes; shift_labels (labels shifted already, e.g. by
                sequence parallelism) and an ignore_index other than -100 are refused, not ignored.

        Returns:
            The scalar WIT loss (wit_loss).
        """
        if kwargs.get("shift_labels") is not None or kwargs.get("ignore_index", -100) != -100:
            raise ValueError("WITLoss reads unshifted labels with -100 for no loss; this model call passed "
                             "shift_labels or another ignore_index, which it cannot honour")
        return wit_loss(logits, labels, self.prompt_weight, self.response_weight, num_items_in_batch)


def use_wit_loss(model: nn.Module, loss: WITLoss) -> None:
    """Makes the model itself compute WIT when called with labels: Trainer then passes it the
    labels and the global token count, and hooks on the model (SpectralMonitor) see them.

    Args:
        model: A transformers model; its ``loss_function`` is replaced.
        loss: The WIT weights to compute with.
    """
    model.loss_function = loss.model_loss


@dataclass
class WITCollator:
    """Rows (Alpaca fields or chat messages, as gradspec score reads them) -> right-padded
    input_ids, attention_mask and WIT labels, with either template.

    A row with no response token (its response cannot be located, is empty, or lies beyond
    max_length) gets no labels: it trains on nothing, not on its prompt alone. Rows that carry a
    ``sample_index`` (gradspec.training.with_sample_index) give the batch that column, the spectral
    monitor's map back to the data.

    Args:
        tokenizer: The model's tokenizer.
        prompt_weight: lp, as for WITLoss: 0 leaves the prompt unlabelled.
        template: "plain" or "chat" (the tokenizer's chat template), as gradspec score's.
        max_length: Tokens kept per row (truncated on the right).
        fields: The rows' text field names.
        response_weight: lr, as for WITLoss: 0 leaves the response unlabelled.
    """

    tokenizer: Any
    prompt_weight: float = 0.0
    template: str = "plain"
    max_length: int = MAX_LENGTH
    fields: Fields = Fields()
    response_weight: float = 1.0

    def __post_init__(self) -> None:
        check_weights(self.prompt_weight, self.response_weight)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Collates a batch.

        Args:
            rows: The batch's dataset rows.

        Returns:
            "input_ids", "attention_mask" and "labels", each (N, T) int64, right-padded, on the CPU;
            "sample_index" (N,) int64 where the rows carry it.
        """
        indices = sample_indices(rows)
        tokens = [tokenize(to_sample(i, f"batch row {i}", row, self.fields).messages, self.tokenizer,
                           self.template, self.max_length) for i, row in enumerate(rows)]
        pad_id = pad_id_of(self.tokenizer)
        input_ids, attention_mask, labels = pad_batch(tokens, pad_id, "cpu")
        response = labels != IGNORE_INDEX
        labels = encode_labels(input_ids, response, attention_mask, self.prompt_weight, self.response_weight)
        # A row whose spans could not be located (label_span_mismatch) or that has nothing to learn
        # trains on nothing, not on its prompt alone
        labels[torch.tensor([not t.scorable for t in tokens])] = IGNORE_INDEX
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return batch if indices is None else {**batch, SAMPLE_INDEX: indices}
