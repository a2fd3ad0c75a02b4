"""Live spectral monitor: per-sample gradient spectra of training batches, from the training
step's own forward and backward (hooks, no extra pass), every N optimizer steps.

Each sample's share of the step's gradient is rescaled to the gradient of the sample's own mean
loss (x N / n_i, N the loss's token denominator, n_i the sample's labelled tokens), so the rows
equal `gradspec score` on the same batch and weights. That needs the labels in the model call
(the model computes the loss: plain Trainer, or WIT installed with ``use_wit_loss``); where a
trainer computes the loss itself (SFTMix), rows hold the unscaled share and say so.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import TrainerCallback

from .engine import IGNORE_INDEX, Capture
from .metrics import METRICS
from .modules import select_targets
from .output import column, metric_columns


class SpectralMonitor(TrainerCallback):
    """A Trainer callback; rows go to ``out`` (Parquet, appended) and per-module means to the logs."""

    def __init__(self, every: int = 50, modules: str | list[str] = "attn", out: str | Path | None = None,
                 backend: str = "auto") -> None:
        self.every, self.modules, self.backend = every, modules, backend
        self.out = None if out is None else Path(out)
        self.active = False
        self.captures: list[tuple[Capture, torch.Tensor, bool]] = []  # (capture, response tokens, scaled)
        self.pending_logs: dict[str, float] = {}
        self._stash: dict[str, Any] = {}
        self._stack = ExitStack()
        self._writer: pq.ParquetWriter | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if getattr(args, "gradient_checkpointing", False):
            raise ValueError("SpectralMonitor reads activations from the forward pass: turn gradient checkpointing off")
        self.targets = select_targets(model, self.modules)
        self.model = model
        self._handles = [
            model.register_forward_pre_hook(self._see_labels, with_kwargs=True),
            model.base_model.register_forward_pre_hook(self._start_capture, with_kwargs=True),
            model.base_model.register_forward_hook(lambda *_: self._stack.close()),
        ]

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step % self.every == 0

    def _see_labels(self, module, args, kwargs):
        if self.active:
            self._stash = {"labels": kwargs.get("labels"), "num_items": kwargs.get("num_items_in_batch")}

    def _start_capture(self, module, args, kwargs):
        if not self.active or not torch.is_grad_enabled():
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths = mask.sum(1) if mask is not None else torch.full((len(ids),), ids.shape[1], device=ids.device)
        labels, num_items = self._stash.pop("labels", None), self._stash.pop("num_items", None)
        scale = None
        if labels is not None:
            counts = (labels[:, 1:] != IGNORE_INDEX).sum(1)
            total = counts.sum() if num_items is None else torch.as_tensor(num_items, device=counts.device)
            scale = torch.where(counts > 0, total.to(torch.float64) / counts.clamp_min(1), 0.0)
        else:  # which tokens carry loss is not known here: every sample is reduced, unscaled
            counts = lengths - 1
        capture = Capture(self.targets, lengths, self.backend, None, METRICS, scale)
        self._stack.enter_context(capture.hooks(self.model))
        self.captures.append((capture, counts, labels is not None))

    def on_step_end(self, args, state, control, **kwargs):
        if not self.captures:
            return
        rows = []
        for micro_batch, (capture, counts, scaled) in enumerate(self.captures):
            capture.to_host()
            counts = counts.cpu()
            flags: list[set[str]] = [set() for _ in counts]
            metrics, _ = capture.reduce(counts > 0, flags, keep_spectra=False)
            for i in range(len(counts)):
                row = {"step": state.global_step, "micro_batch": micro_batch, "row": i,
                       "num_tokens": int(capture.lengths[i]), "num_response_tokens": int(counts[i]) if scaled else None,
                       "scaled": scaled, "status": ";".join(sorted(flags[i])) or "ok"}
                rows.append({**row, **metric_columns(metrics, i, METRICS)})
        self.captures = []
        self.pending_logs = _summary(rows, self.targets)
        if self.out is not None:
            self._append(rows)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Adds the latest summaries to the log record (callbacks after this one see them too)."""
        if logs is not None and self.pending_logs:
            logs.update(self.pending_logs)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending_logs)
            self.pending_logs = {}

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _append(self, rows: list[dict[str, Any]]) -> None:
        table = pa.Table.from_pylist(rows)
        if self._writer is None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.out, table.schema)
        self._writer.write_table(table.cast(self._writer.schema))


def _summary(rows: list[dict[str, Any]], targets) -> dict[str, float]:
    """Mean over samples and layers of nuclear norm and effective rank, per module role."""
    out: dict[str, list[float]] = {}
    for t in targets:
        for part in t.parts:
            for metric in ("nuclear_norm", "effective_rank"):
                values = [r[column(part.name, metric)] for r in rows]
                out.setdefault(f"spectra/{part.role}/{metric}", []).extend(v for v in values if math.isfinite(v))
    return {k: sum(v) / len(v) for k, v in out.items() if v}
