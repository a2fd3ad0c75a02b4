"""Where each sample of a monitored micro-batch is: its tokens, its labels and its dataset index.

A sample is a row of a right-padded batch, or one sequence of a packed (padding-free) batch: sequences
delimited by position ids that restart within a row, or by flash attention's ``cu_seq_lens``. A packed
sequence's tokens are gathered from the packed rows (``gradspec.layers.hooks.PackedLayout``); its first
label must be -100, as DataCollatorWithFlattening makes it. Left-padded rows are refused with a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gradspec.data.templates import IGNORE_INDEX
from gradspec.layers.hooks import BatchLayout, PackedLayout, token_mask


class SampleLayout(NamedTuple):
    """A micro-batch's samples as the hooks and the rows see them."""

    layout: BatchLayout  # what the hooks capture: a BatchLayout, or a PackedLayout
    lengths: torch.Tensor  # each sample's tokens
    owner: torch.Tensor  # (rows, T): each position's sample (its row, or its packed sequence)
    labels: torch.Tensor | None  # each sample's labels, right-padded with IGNORE_INDEX (None: no labels)
    responses: torch.Tensor | None  # each sample's response targets (None: no labels)
    device: torch.device  # the model input's


def sample_layout(args: tuple, kwargs: dict[str, Any], labels: torch.Tensor | None) -> SampleLayout:
    """The samples of a model call (its positional args and keywords; labels as the model call got them)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    tokens_in = ids if ids is not None else kwargs["inputs_embeds"]
    sequences = packed_sequences(kwargs, tokens_in.shape[:2])
    if sequences is None:  # one sample per row, right-padded
        lengths = _lengths(kwargs.get("attention_mask"), tokens_in)
        layout, own_labels = BatchLayout(lengths, lengths.device), labels
        owner = torch.arange(len(lengths), device=tokens_in.device)[:, None].expand(tokens_in.shape[:2])
    else:  # one sample per packed sequence
        layout = PackedLayout(sequences, tuple(tokens_in.shape[:2]), tokens_in.device)
        lengths, owner = layout.lengths, layout.owner
        own_labels = None if labels is None else _sequence_labels(labels, layout)
    responses = None if labels is None else (own_labels[:, 1:] >= 0).sum(1)
    return SampleLayout(layout, lengths, owner, own_labels, responses, tokens_in.device)


def dataset_indices(given: Any, samples: int, step_indices: Sequence[int] | None, done: int,
                    index_column: str | None) -> list[int | None]:
    """Each sample's dataset index: from the batch's index column (given), else from the step's indices
    (over its micro-batches in order; done: the samples of its earlier micro-batches), else None."""
    indices = [None] * samples if given is None else [int(i) for i in torch.as_tensor(given).tolist()]
    if len(indices) != samples:
        raise ValueError(f"SpectralMonitor: {index_column} has {len(indices)} entries for this "
                         f"batch's {samples} samples (a packed batch: one per sequence)")
    if given is None and step_indices is not None:
        indices = (list(step_indices[done : done + samples]) + indices)[:samples]
    return indices


def packed_sequences(kwargs: dict[str, Any], shape: tuple[int, int]) -> list[tuple[int, int, int]] | None:
    """(row, start, length) of each sequence where a batch packs several per row: from position ids
    that restart within a row, or flash-attention's cu_seq_lens (DataCollatorWithFlattening); None
    where each row is one sample."""
    R, T = shape
    positions, bounds = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    mask = kwargs.get("attention_mask")
    valid = mask.sum(1).tolist() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else [T] * R
    if positions is not None and _restarts(positions, mask if isinstance(mask, torch.Tensor) else None):
        positions = positions.expand(R, T).cpu()
        sequences = []
        for r in range(R):
            n = int(valid[r])
            starts = [0, *(1 + torch.nonzero(positions[r, 1:n] <= positions[r, : n - 1]).flatten()).tolist(), n]
            sequences += [(r, a, b - a) for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]
        return sequences
    if bounds is not None and R == 1:
        edges = bounds.cpu().tolist()
        return [(0, a, b - a) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a] if len(edges) > 2 else None
    return None


def _sequence_labels(labels: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Each packed sequence's labels, right-padded with IGNORE_INDEX. A sequence after the first of
    its row must have no target at its first token: that would be a loss across the boundary, from
    the previous sequence's last position (DataCollatorWithFlattening puts -100 there)."""
    heads = [(r, start) for r, start, _ in layout.sequences if start > 0]
    if heads:
        rows, cols = torch.tensor(heads).T
        if (labels[rows.to(labels.device), cols.to(labels.device)] != IGNORE_INDEX).any():
            raise ValueError("SpectralMonitor: a packed sequence's first label is not -100, so the loss runs across "
                             "the sequences' boundary; label each sequence's first token -100 (as "
                             "DataCollatorWithFlattening does)")
    return layout.gather(labels, IGNORE_INDEX)


def _restarts(positions: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a position id falls back within a row's real tokens (a new packed sequence begins)."""
    fall = positions[..., 1:] <= positions[..., :-1]
    if mask is not None and mask.dim() == 2:
        fall = fall & mask[:, 1:].bool()
    return bool(fall.any())


def _lengths(mask: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's token count; the hooks take a row's first `length` positions as the sample."""
    if mask is None:
        return torch.full((tokens.shape[0],), tokens.shape[1], device=tokens.device)
    if mask.dim() != 2:
        raise ValueError(f"SpectralMonitor needs a 2-D attention_mask (batch x tokens), got shape {tuple(mask.shape)}")
    lengths = mask.sum(1)
    if not torch.equal(mask.bool(), token_mask(lengths, mask.shape[1], mask.device)):
        raise ValueError("SpectralMonitor needs right-padded batches (each attention_mask row a prefix of ones): "
                         "this batch is left-padded or has holes; pad on the right (tokenizer.padding_side = 'right')")
    return lengths
