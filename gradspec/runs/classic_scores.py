"""Classic per-sample data-quality scores, computed in the same run as the spectra.

- ``perplexity``: exp of the response loss given the prompt.
- ``loss_response_alone``: mean loss of the response tokenized on its own (no prompt), from an
  extra forward pass without gradients.
- ``ifd``: Cherry-LLM's Instruction-Following Difficulty, loss given the prompt / loss alone.
- ``superfiltering_ifd``: the perplexity ratio used by Superfiltering, exp(loss given prompt - loss alone).
- ``mean_entropy``, ``token_accuracy``, ``mean_token_prob``: mean predictive entropy (nats),
  teacher-forced accuracy and mean probability of the target token over the response tokens
  (from the scoring forward itself).
- ``response_chars``: characters in the response (``num_response_tokens`` counts its tokens).
"""

from __future__ import annotations

import math

import torch

from gradspec.data.batching import Item
from gradspec.data.readers import Sample
from gradspec.data.templates import JOINED, Tokenized, scored
from gradspec.engine.loss import item_losses

CLASSIC_COLUMNS = ("perplexity", "loss_response_alone", "ifd", "superfiltering_ifd", "mean_entropy",
                   "token_accuracy", "mean_token_prob", "response_chars")


def response_text(sample: Sample, eos: str = "") -> str:
    """The text the model is scored on: the scored assistant turns, joined by newlines, a JOINED one
    (TRL's text completion) ending in eos as the full text has it."""
    return "\n".join(m["content"] + (eos if m.get(JOINED) and eos and not m["content"].endswith(eos) else "")
                     for m in sample.messages if scored(m))


def losses_alone(
    model: torch.nn.Module, tokenizer, samples: list[Sample], max_length: int, batch_tokens: int
) -> dict[int, float]:
    """Sample index -> mean next-token loss of its response tokenized alone (NaN if under 2 tokens)."""
    items = []
    for s in samples:
        ids = tokenizer(response_text(s, getattr(tokenizer, "eos_token", None) or ""))["input_ids"][:max_length]
        items.append(Item(s, Tokenized(ids, list(ids), "ok")))
    return {item.sample.index: loss for item, loss, _ in item_losses(model, tokenizer, items, batch_tokens)}


def loss_ratios(loss: float, loss_alone: float) -> dict[str, float]:
    """The columns derived from the loss given the prompt and the loss of the response alone."""
    return {
        "perplexity": math.exp(loss),
        "loss_response_alone": loss_alone,
        "ifd": loss / loss_alone if loss_alone > 0 else math.nan,
        "superfiltering_ifd": math.exp(loss - loss_alone),
    }
