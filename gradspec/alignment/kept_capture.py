"""The capture every alignment pass builds on (the task's two passes, K-FAC's factors, the projected
store, the pool against a task): per part, tensors over the batch's samples, copied to the host
once the batch is captured. Its own module so that the task and the pool's capture, which reads the
task, both import it and not each other."""

from __future__ import annotations

import torch

from gradspec.layers.hooks import BatchLayout, Capture
from gradspec.layers.registry import Target
from gradspec.linalg.host_copies import HostCopies


class KeptCapture(Capture):
    """A capture whose results, kept per part in ``kept`` as tensors over the batch's N samples, are
    copied to the host by to_host (pinned, on the caller's thread, so they do not queue behind the
    next batch's device work) and given back by release."""

    def __init__(self, targets: list[Target], batch: BatchLayout) -> None:
        super().__init__(targets, batch)
        self.kept: dict[str, tuple[torch.Tensor, ...]] = {}
        self._copies = HostCopies()

    def to_host(self) -> None:
        self.kept = {name: tuple(self._copies(t) for t in values) for name, values in self.kept.items()}
        self._copies.queued()

    def wait_host(self) -> None:
        self._copies.wait()

    def release(self) -> None:
        self.kept = {}
