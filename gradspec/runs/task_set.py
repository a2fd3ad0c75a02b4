"""A task file (the examples a pool is aligned with) read, tokenized and batched like the pool."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gradspec.choices import MAX_LENGTH
from gradspec.data.batching import pad_batch, pad_id_of
from gradspec.data.readers import Fields, data_samples
from gradspec.data.templates import tokenize

log = logging.getLogger("gradspec")


def task_batches(
    path: str | Path, tokenizer, fields: Fields = Fields(), template: str = "plain", max_length: int = MAX_LENGTH,
    batch_tokens: int = 4096, device: str | torch.device = "cpu", limit: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded batches of the task file's scorable examples, in file order (within
    batch_tokens padded tokens each). Rows the tokenizer cannot score are left out with a warning;
    a file with none to score is an error that names it."""
    return task_examples(path, tokenizer, fields, template, max_length, batch_tokens, device, limit)[0]


def task_examples(
    path: str | Path, tokenizer, fields: Fields = Fields(), template: str = "plain", max_length: int = MAX_LENGTH,
    batch_tokens: int = 4096, device: str | torch.device = "cpu", limit: int | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[int]]:
    """task_batches, and the file row of each example in them (the first limit rows read)."""
    tokens, unscorable, rows = [], [], []
    for sample in data_samples(path, fields, limit):
        t = tokenize(sample.messages, tokenizer, template, max_length)
        (tokens if t.scorable else unscorable).append(t if t.scorable else (sample.index, t.status))
        if t.scorable:
            rows.append(sample.index)
    if unscorable:
        log.warning("task file %s: rows %s have no response tokens to score (%s); left out", path,
                    [i for i, _ in unscorable], ", ".join(sorted({s for _, s in unscorable})))
    if not tokens:
        raise ValueError(f"task file {path}: no row has response tokens to score (template {template!r})")
    batches, batch = [], []
    for t in tokens:
        if batch and (len(batch) + 1) * max(t.num_tokens, *(b.num_tokens for b in batch)) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(t)
    batches.append(batch)
    return [pad_batch(b, pad_id_of(tokenizer), device) for b in batches], rows
