"""One monitored micro-batch: its capture, which never fails the training step it watches, and what its
rows need besides the spectra (samples, loss, dataset indices), from its forward to its eigen stage."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from gradspec.engine.capture import BatchCapture
from gradspec.layers.registry import Target
from gradspec.linalg.metrics import metric_names
from gradspec.training.monitor_layout import SampleLayout
from gradspec.training.monitor_loss import SampleLoss, output_losses

log = logging.getLogger("gradspec")


class MonitorCapture(BatchCapture):
    """A micro-batch's capture that never fails the training step it watches: a fault in a hook (out of GPU
    memory forming Grams, say) drops this micro-batch's spectra, frees what they held and lets the
    backward go on; its rows say monitor_failed."""

    failed: str | None = None

    def on_part(self, part, captured) -> None:
        if self.failed is not None:
            return
        try:
            super().on_part(part, captured)
        except Exception as error:  # noqa: BLE001 - the user's training must not die of the monitor
            self.fail(error)

    def fail(self, error: BaseException) -> None:
        self.failed = f"{type(error).__name__}: {str(error)[:200]}"
        self.release()
        log.warning("SpectralMonitor: this micro-batch's spectra are dropped (%s); training goes on", self.failed)


class MicroBatch(NamedTuple):
    """A captured micro-batch: filled by its forward (losses) and its eigen stage (reduced)."""

    capture: MonitorCapture
    loss_kind: str
    tokens: torch.Tensor  # n_i where scaled; else every token but the first
    responses: torch.Tensor | None  # response targets per sample (None: no labels in the model call)
    scaled: bool
    indices: list[int | None]  # dataset index per row
    labels: torch.Tensor | None  # as the model got them: (rows, T)
    owner: torch.Tensor  # (rows, T): each position's sample (its row, or its packed sequence)
    weights: tuple[float, float] | None  # the loss's (prompt, response) token weights
    losses: list  # [l_i / n_i (N,)] once the forward has returned logits, where scaled
    reduced: list  # [(metrics, flags)] once its eigen stage has run (its Grams then freed)

    @classmethod
    def start(cls, targets: list[Target], backend: str, samples: SampleLayout, loss: SampleLoss,
              scale: torch.Tensor | None, labels: torch.Tensor | None, indices: list[int | None]) -> MicroBatch:
        """A micro-batch whose forward begins: its capture made (scale: N / n_i where the rows are scaled),
        for the caller to hook. labels: as the model got them."""
        capture = MonitorCapture(targets, samples.layout, backend, None, metric_names(), scale)
        return cls(capture, loss.kind, loss.tokens, samples.responses, loss.scaled, indices, labels, samples.owner,
                   loss.weights, [], [])

    def record_losses(self, output: Any) -> None:
        """Each sample's loss value, from the model call's output, where the rows are scaled (once)."""
        if not self.scaled or self.losses:
            return
        try:
            losses = output_losses(output, self.labels, self.weights, self.owner, self.tokens)
        except Exception as error:  # noqa: BLE001 - out of memory gathering the logits must not end the step
            self.capture.fail(error)
            return
        if losses is not None:
            self.losses.append(losses)

    def reduce(self) -> None:
        """The eigen stage (once its backward has run), its metrics and flags kept, its Grams freed."""
        if self.reduced:
            return
        capture, tokens = self.capture, self.tokens.cpu()
        capture.to_host()
        flags: list[set[str]] = [set() if n > 0 else {"no_loss_tokens"} for n in tokens.tolist()]
        scored = tokens > 0
        if capture.failed is not None:  # no part's spectra: NaN, flagged once, not each part as missing
            flags, scored = [f | {"monitor_failed"} for f in flags], torch.zeros_like(scored)
        metrics, _ = capture.reduce(scored, flags, keep_spectra=False)
        capture.release()
        self.reduced.append((metrics, flags))
