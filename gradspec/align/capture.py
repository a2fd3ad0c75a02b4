"""The pool's capture: per scored part, each sample's inner products with the task's directions
and its squared gradient norm, as the part's output gradient arrives."""

from __future__ import annotations

import torch

from gradspec.align.directions import PartDirections
from gradspec.engine.capture import PartHooks
from gradspec.kernels import token_mask
from gradspec.layers.targets import Part, Target


class PaddedBatchHooks(PartHooks):
    """PartHooks for a right-padded batch: its host lengths and its token mask on the device."""

    measures = False  # no path here is measured against another

    def __init__(self, targets: list[Target], lengths: torch.Tensor, device: torch.device | str) -> None:
        super().__init__(targets)
        self.lengths = lengths.cpu().tolist()
        self.mask = token_mask(lengths, max(self.lengths, default=0), device)

    def to_host(self) -> None:
        self.inputs.clear()


class AlignmentCapture(PaddedBatchHooks):
    """A pool batch: per part, <G_i, W_k> (N, K) and ||G_i||^2 (N,) at dtype."""

    def __init__(self, targets: list[Target], lengths: torch.Tensor, device: torch.device | str,
                 directions: dict[str, PartDirections], dtype: torch.dtype) -> None:
        super().__init__(targets, lengths, device)
        self.directions, self.dtype = directions, dtype
        self.results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_part(self, part: Part, X: torch.Tensor, D: torch.Tensor) -> None:
        self.results[part.name] = self.directions[part.name].inner(X, D, self.mask, self.lengths, self.dtype)
