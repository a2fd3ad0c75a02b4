"""The pool's capture: per scored part, each sample's inner products with the task's directions
and its squared gradient norm, as the part's output gradient arrives."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gradspec.engine.capture import PartHooks
from gradspec.kernels import token_mask
from gradspec.layers.targets import Part, Target
from gradspec.linalg.host_copies import HostCopies

if TYPE_CHECKING:
    from gradspec.align.task import TaskGradients


class PaddedBatchHooks(PartHooks):
    """PartHooks for a right-padded batch: its host lengths and its token mask on the device; what
    subclasses keep in ``kept`` is copied to the host by to_host (pinned, on the caller's thread, so
    it does not queue behind the next batch's device work) and given back by release."""

    measures = False  # no path here is measured against another

    def __init__(self, targets: list[Target], lengths: torch.Tensor, device: torch.device | str) -> None:
        super().__init__(targets)
        self.lengths = lengths.cpu().tolist()
        self.mask = token_mask(lengths, max(self.lengths, default=0), device)
        self.kept: dict[str, tuple[torch.Tensor, ...]] = {}
        self._copies = HostCopies()

    def to_host(self) -> None:
        self.inputs.clear()
        self.kept = {name: tuple(self._copies(t) for t in values) for name, values in self.kept.items()}
        self._copies.wait()

    def release(self) -> None:
        self.kept = {}
        self._copies.release()


class AlignmentCapture(PaddedBatchHooks):
    """A pool batch against one task (kept with the batch, so a later set_task does not change it):
    per part, kept[part] = (<G_i, W_k> (N, K), ||G_i||^2 (N,)) at dtype."""

    def __init__(self, targets: list[Target], lengths: torch.Tensor, device: torch.device | str,
                 task: TaskGradients, dtype: torch.dtype) -> None:
        super().__init__(targets, lengths, device)
        self.task, self.dtype = task, dtype

    def on_part(self, part: Part, X: torch.Tensor, D: torch.Tensor) -> None:
        self.kept[part.name] = self.task.parts[part.name].inner(X, D, self.mask, self.lengths, self.dtype)
