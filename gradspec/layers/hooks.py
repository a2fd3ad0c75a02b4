"""The one capture protocol: every layer kind delivers, for each scored part, the inputs X and
output gradients D of the samples that reached it (a Captured); every consumer of gradients (the
spectra, the alignment, the projection, the monitor) is a Capture that receives them. One set of
hooks per batch serves all of a pass's captures (``attached``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from gradspec.layers.checkpointing import PLAIN, Phase, phase
from gradspec.layers.registry import Part, Target
from gradspec.linalg.host_copies import to_device


def token_mask(lengths: torch.Tensor, T: int, device: torch.device | str) -> torch.Tensor:
    """(N, T) bool: True at each sample's valid (unpadded) tokens."""
    return torch.arange(T, device=device)[None, :] < to_device(lengths, device)[:, None]  # a host copy: no wait


class BatchLayout:
    """A right-padded batch as the hooks see it: each sample's length on the host (decided before
    the forward, so no hook waits for the device) and on each device a module runs on (a model
    dispatched over several devices: each module's X and D lie on its own); kinds that route
    tokens record each sample's routed-token count per expert in routed_tokens ({"<experts>.<e>": (N,)})."""

    def __init__(self, lengths: torch.Tensor, device: torch.device | str) -> None:
        self.lengths = lengths.cpu().to(torch.int64)
        self.device = torch.device(device)  # the batch's input's
        self.routed_tokens: dict[str, torch.Tensor] = {}
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}
        # Parts whose gradient came from more than one call or backward (a module used twice): a
        # capture sees one of them, so their rows are flagged, not summed silently.
        self.repeated: set[str] = set()
        # Whether a hook ran inside a checkpointed region (any torch checkpoint, not only transformers'): the
        # capture then solves each input's eigen stage once the input is gone, as memory is scarce there.
        self.checkpointed = False

    @property
    def N(self) -> int:
        return len(self.lengths)

    def phase(self) -> Phase:
        """The current forward's run (gradspec.layers.checkpointing.phase), a checkpointed one noted."""
        now = phase()
        # a re-entrant checkpoint's recompute is a plain forward, but it runs within the backward
        if now.kind != PLAIN or torch._C._current_graph_task_id() != -1:
            self.checkpointed = True
        return now

    def cached_on(self, what: str, device: torch.device, make) -> torch.Tensor:
        """make(device), once per batch and device."""
        key = (what, torch.device(device))
        if key not in self._on:
            self._on[key] = make(key[1])
        return self._on[key]

    def lengths_on(self, device: torch.device) -> torch.Tensor:
        return self.cached_on("lengths", device, lambda d: to_device(self.lengths, d))

    def mask_on(self, device: torch.device) -> torch.Tensor:
        """(N, longest) bool on device: True at each sample's tokens."""
        return self.cached_on("mask", device,
                              lambda d: token_mask(self.lengths, int(self.lengths.max()) if self.N else 0, d))

    @property
    def device_lengths(self) -> torch.Tensor:
        return self.lengths_on(self.device)

    @property
    def mask(self) -> torch.Tensor:
        return self.mask_on(self.device)

    @property
    def rows(self) -> int:
        """Rows of the model's input (one sample each here)."""
        return self.N

    def token_owner(self, device: torch.device) -> torch.Tensor:
        """(rows x T,) on device: each input position's sample, N where none (padding); for kinds
        that route tokens (MoE experts)."""
        return self.cached_on("token_owner", device, lambda d: torch.where(
            self.mask_on(d), torch.arange(self.N, device=d)[:, None], self.N).flatten())

    def whole(self, X: torch.Tensor, D: torch.Tensor) -> Captured:
        """The batch's own layout: every sample, its own tokens (dense layers)."""
        return Captured(X, D, self.lengths, None, self, layout="batch", input_key=input_key(X))


class PackedLayout(BatchLayout):
    """A packed (padding-free) batch: several sequences per row, each a sample, given as (row,
    start, length) runs of the (rows, T) input. ``whole`` gathers them into right-padded
    (sequences, longest, d) tensors, so every capture sees one sample per row, as in a padded batch."""

    def __init__(self, sequences: list[tuple[int, int, int]], shape: tuple[int, int], device: torch.device | str
                 ) -> None:
        super().__init__(torch.tensor([n for _, _, n in sequences], dtype=torch.int64), device)
        self.shape, self.sequences = shape, sequences
        R, T = shape
        longest = int(self.lengths.max()) if sequences else 0
        steps = torch.arange(longest)
        self.index = torch.stack([torch.where(steps < n, r * T + start + steps, R * T) for r, start, n in sequences]) \
            if sequences else torch.zeros(0, 0, dtype=torch.int64)  # (S, longest) into the rows' tokens; R*T: zero

    @property
    def rows(self) -> int:
        return self.shape[0]

    def _sequence_of_positions(self, none: int) -> torch.Tensor:
        """(rows, T) on the host: each position's sequence, `none` where there is none."""
        owner = torch.full(self.shape, none, dtype=torch.int64)
        for j, (r, start, n) in enumerate(self.sequences):
            owner[r, start : start + n] = j
        return owner

    @cached_property
    def owner(self) -> torch.Tensor:
        """(rows, T) on the device: each position's sequence (0 where none)."""
        return to_device(self._sequence_of_positions(0), self.device)

    def token_owner(self, device: torch.device) -> torch.Tensor:
        return self.cached_on("token_owner", device,
                              lambda d: to_device(self._sequence_of_positions(self.N).flatten(), d))

    def gather(self, Y: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """(rows, T, ...) -> (sequences, longest, ...), `fill` past each sequence's end."""
        flat = Y.reshape(-1, *Y.shape[2:])
        index = self.cached_on("index", Y.device, lambda d: to_device(self.index, d))
        return torch.cat([flat, flat.new_full((1, *flat.shape[1:]), fill)])[index]

    def whole(self, X: torch.Tensor, D: torch.Tensor) -> Captured:
        return Captured(self.gather(X), self.gather(D), self.lengths, None, self, layout="batch",
                        input_key=input_key(X))


@dataclass
class Captured:
    """One part's X (n, t, d_in) and D (n, t, d_out) for n samples, right-padded: sample k's first
    lengths[k] rows are its tokens here. rows: their batch rows (None: all N in order). layout names
    the (rows, lengths) arrangement, input_key the input X (parts reading one X share its Gram)."""

    X: torch.Tensor
    D: torch.Tensor
    lengths: torch.Tensor
    rows: tuple[int, ...] | None
    batch: BatchLayout
    layout: object
    input_key: object
    index: torch.Tensor | None = None  # rows on the device
    device_lengths_: torch.Tensor | None = field(default=None, repr=False)

    def with_D(self, D: torch.Tensor) -> Captured:
        return Captured(self.X, D, self.lengths, self.rows, self.batch, self.layout, self.input_key, self.index,
                        self.device_lengths_)

    def batch_row(self, k: int) -> int:
        return k if self.rows is None else self.rows[k]

    @property
    def batch_rows(self) -> tuple[int, ...]:
        return tuple(range(self.batch.N)) if self.rows is None else self.rows

    @property
    def device_lengths(self) -> torch.Tensor:
        """On X's device."""
        if self.rows is None:
            return self.batch.lengths_on(self.X.device)
        if self.device_lengths_ is None:
            self.device_lengths_ = to_device(self.lengths, self.X.device)
        return self.device_lengths_

    @property
    def mask(self) -> torch.Tensor:
        """(n, longest here) bool on X's device."""
        if self.rows is None:
            return self.batch.mask_on(self.X.device)
        return token_mask(self.device_lengths, int(self.lengths.max()) if len(self.lengths) else 0, self.X.device)

    def _index(self, device: torch.device) -> torch.Tensor:
        """The batch rows on this device (rows is not None)."""
        index = self.index if self.index is not None else torch.tensor(self.rows)
        return to_device(index, device)

    def of_rows(self, values: torch.Tensor) -> torch.Tensor:
        """These samples' entries of a per-batch-row tensor (N, ...)."""
        return values if self.rows is None else values[self._index(values.device)]

    def scatter(self, values: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        """(n, ...) values of these samples -> (N, ...), zero (or fill, shaped like one sample's values)
        at the samples that did not reach the part."""
        if self.rows is None:
            return values
        full = values.new_zeros((self.batch.N, *values.shape[1:])) if fill is None else \
            fill.to(values).expand(self.batch.N, *values.shape[1:]).clone()
        return full.index_copy_(0, self._index(values.device), values)


def input_key(X: torch.Tensor) -> InputKey:
    """Identifies one input tensor across the modules that read it (q, k, v; gate, up)."""
    return InputKey(X)


class InputKey:
    """An input's address, shape and strides, valid while its storage lives: under activation
    checkpointing a recomputed input is freed within the backward and its address reused by the
    next region's, which must not match it (a dead storage equals nothing)."""

    __slots__ = ("_hash", "_key", "_storage")

    def __init__(self, X: torch.Tensor) -> None:
        self._key = (X.data_ptr(), tuple(X.shape), X.stride())
        self._storage = weakref.ref(X.untyped_storage())
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def alive(self) -> bool:
        """Whether the input's storage still exists (a module may still deliver a part reading it)."""
        return self._storage() is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputKey) or self._key != other._key:
            return False
        storage = self._storage()
        return storage is not None and storage is other._storage()


class Capture:
    """A consumer of one batch's captured gradients. on_part gets each part's Captured as its gradient
    arrives; to_host moves what it keeps to the host once the backward is done; finish(scores) adds
    its results to the batch's BatchScores; release drops what it held (Grams, host copies)."""

    measures = False  # whether an eigen stage will be measured on this batch (no consumer but the spectra's)
    # whether on_part takes a Stack (gradspec.layers.registry): many parts' rows in one Captured
    takes_stacks = False

    def __init__(self, targets: list[Target], batch: BatchLayout) -> None:
        self.targets, self.batch = targets, batch

    @property
    def lengths(self) -> torch.Tensor:
        return self.batch.lengths

    def on_part(self, part: Part, captured: Captured) -> None:
        raise NotImplementedError

    def to_host(self) -> None:
        pass

    def wait_host(self) -> None:
        """Blocks until to_host's copies have landed (the thread that reads them calls it)."""

    def finish(self, scores) -> None:
        pass

    def release(self) -> None:
        pass


def _delivery(captures: list[Capture]) -> Callable[[Part, Captured], None] | None:
    """deliver(part, captured) to each of these captures in turn; None where there are none."""
    if not captures:
        return None

    def deliver(part: Part, captured: Captured) -> None:
        for capture in captures:
            capture.on_part(part, captured)

    return deliver


@contextmanager
def attached(model: nn.Module, captures: list[Capture]) -> Iterator[None]:
    """Every target's hooks on the model for one batch, delivering to each capture in turn; removed
    after (also on error), so the model is left as it was found. All captures share the batch."""
    if not captures:
        yield
        return
    batch, targets = captures[0].batch, captures[0].targets
    if any(c.batch is not batch for c in captures):
        raise ValueError("the captures of one pass must share its BatchLayout")

    deliver = _delivery(captures)
    # A kind that can deliver its parts as Stacks (experts) hands them so to the captures that take them
    # (deliver.stacked) and each part alone to the others (deliver.alone); either is None where no capture is such.
    deliver.stacked = _delivery([c for c in captures if c.takes_stacks])
    deliver.alone = _delivery([c for c in captures if not c.takes_stacks])
    handles = []
    try:
        for target in targets:
            handles.extend(target.attach(batch, deliver))
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()
