"""Batching tokenized samples: length-sorted, under a token budget, with little padding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from gradspec.choices import BATCH_TOKENS, CPU_BATCH_TOKENS
from gradspec.data.sample import Sample
from gradspec.data.templates import IGNORE_INDEX, Tokenized

MAX_PADDING = 0.2  # share of a batch's tokens that may be padding


@dataclass
class Item:
    """A sample with its tokens."""

    sample: Sample
    tokens: Tokenized


def batch_tokens_for(device: str | torch.device | None, device_map: str | None = None) -> int:
    """score's default padded tokens per batch: CPU_BATCH_TOKENS on the CPU (1,024 to 4,096 scored
    HumanEval within 5% of each other on 2 cores: benchmarks/RESULTS.md), BATCH_TOKENS on a GPU."""
    on_cpu = device_map is None and torch.device(device or "cpu").type == "cpu"
    return CPU_BATCH_TOKENS if on_cpu else BATCH_TOKENS


def pad_id_of(tokenizer) -> int:
    """The tokenizer's padding id; 0 where it has none (padded positions are masked anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def pad_batch(items: list[Tokenized], pad_id: int, device: str | torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded input_ids, attention_mask and labels."""
    T = max(t.num_tokens for t in items)
    ids = torch.full((len(items), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), T), dtype=torch.long)
    labels = torch.full((len(items), T), IGNORE_INDEX, dtype=torch.long)
    for i, t in enumerate(items):
        n = t.num_tokens
        ids[i, :n] = torch.tensor(t.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(t.labels)
    return ids.to(device), mask.to(device), labels.to(device)


def token_batches(items: list[Item], batch_tokens: int, max_padding: float = MAX_PADDING,
                  fits: Callable[[int, int], bool] | None = None) -> Iterator[list[Item]]:
    """Length-sorted batches whose padded size (count x longest) stays within batch_tokens and
    whose padding stays within max_padding of it: padded tokens cost full compute on a CPU.
    fits(rows, longest), where given, must hold too (a memory model: engine.batch_memory); a sample
    that does not fit alone still gets a batch of its own.

    The same batches on every device: on the CPU too, fuller passes beat one sample per pass
    (1.4x faster on SmolLM2-135M and HumanEval, 2-core AMD EPYC: benchmarks/RESULTS.md)."""
    batch: list[Item] = []
    real = 0
    for item in sorted(items, key=lambda it: it.tokens.num_tokens):
        n = item.tokens.num_tokens
        padded = (len(batch) + 1) * n
        if batch and (padded > batch_tokens or real + n < (1 - max_padding) * padded
                      or (fits is not None and not fits(len(batch) + 1, n))):
            yield batch
            batch, real = [], 0
        batch.append(item)
        real += n
    if batch:
        yield batch

