"""Live spectral monitor: per-sample gradient spectra of training batches, from the training
step's own forward and backward (hooks, no extra pass), every N optimizer steps.

What a row is. The step backpropagates L = sum_i l_i / N, where l_i is sample i's summed
(weighted) token loss and N the loss's denominator, so each hooked module sees, per sample, the
output gradient of l_i / N. The monitor multiplies it by N / n_i, n_i the sample's own
denominator: a row holds the spectrum of d(l_i / n_i)/dW, the gradient of the loss of sample i
trained alone, whichever batch, accumulation split or number of processes it came in. Its
``loss`` column says which loss:

- ``ntp``, the model's own causal-LM loss: l_i = sum of the cross-entropy over its labelled
  (response) tokens, n_i their count (``num_loss_tokens``): the gradient of the sample's mean
  response loss, so rows equal ``gradspec score`` on the same batch and weights.
- ``wit(lp=..,lr=..)``, WIT installed with ``use_wit_loss``: l_i = lp * sum over its prompt
  tokens + lr * sum over its response tokens, n_i = 1[lp != 0] |P_i| + 1[lr != 0] |R_i| (WIT's
  denominator for the sample alone). WIT at (0, 1) is ``ntp``.
- ``unknown``: the trainer computes the loss itself (SFTMix; a ``compute_loss_func`` or a label
  smoother, which take the labels out of the model call), or the model's loss function is neither
  of the above: rows hold each sample's share of the step's gradient as it is (``scaled`` false).

N is what the trainer divides the summed token losses by: Trainer's ``num_items_in_batch`` (the
labelled tokens of the whole accumulated batch, over all processes with
``average_tokens_across_devices``); for a model that takes no loss kwargs, the micro-batch's own
count times the accumulation steps (Trainer divides such a loss by them; in an epoch's shorter
last accumulation it divides by fewer, which the rows do not follow). Under DDP with
``average_tokens_across_devices`` Trainer also multiplies the loss by the number of processes
(so that DDP's gradient average is the global one); the monitor divides that factor out, so each
rank's rows equal one process's rows for the same micro-batch.

Columns: step, micro_batch, row, loss, num_tokens, num_response_tokens (response targets; null
without labels in the model call), num_loss_tokens (n_i; null where not scaled), scaled, status
(``no_loss_tokens`` where n_i = 0: no metrics), then every module's metrics.

Refused with a ValueError: left-padded or packed batches (each row must be one sequence, right
padded), gradient checkpointing (in the Trainer's args or on the model: the recomputed forward
would be captured again) and DataParallel (n_gpu > 1).
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from transformers import TrainerCallback
from transformers.loss.loss_utils import ForCausalLMLoss

from gradspec.data.errors import check_parquet_out
from gradspec.engine.capture import BatchCapture
from gradspec.kernels import token_mask
from gradspec.layers.hooks import BatchLayout, attached
from gradspec.layers.targets import select_targets
from gradspec.linalg.metrics import metric_names
from gradspec.linalg.policy import Policy
from gradspec.runs.score_files import column, metric_columns
from gradspec.training.wit import PROMPT_OFFSET, WITLoss

UNKNOWN = "unknown"
# Keyword arguments of padding-free (packed) batches, as transformers' DataCollatorWithFlattening makes them.
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class _Captured(NamedTuple):
    capture: BatchCapture
    loss: str  # the row's loss column
    tokens: torch.Tensor  # n_i where scaled; else every token but the first
    responses: torch.Tensor | None  # response targets per sample (None: no labels in the model call)
    scaled: bool


class SpectralMonitor(TrainerCallback):
    """A Trainer callback; rows go to ``out`` (Parquet, appended) and per-module means to the logs."""

    def __init__(self, every: int = 50, modules: str | list[str] = "attn", out: str | Path | None = None,
                 backend: str = "auto") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: a whole number of steps, at least 1; got {every!r}")
        if out is not None:
            check_parquet_out(out, "out")
        Policy.of(backend)  # an unknown backend is named now, not at the first monitored step
        self.every, self.modules, self.backend = every, modules, backend
        self.out = None if out is None else Path(out)
        self.active = False
        self.captures: list[_Captured] = []
        self.pending_logs: dict[str, float] = {}
        self._stash: dict[str, Any] = {}
        self._stack = ExitStack()
        self._writer: pq.ParquetWriter | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _refuse_checkpointing(args, model)
        if args.n_gpu > 1:
            raise ValueError("SpectralMonitor hooks one model copy: DataParallel (n_gpu > 1) is not supported; "
                             "run one process per device (torchrun)")
        self.loss_name, self.weights = model_loss(model)
        self.accumulation = args.gradient_accumulation_steps
        self.processes = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        self.targets = select_targets(model, self.modules)
        self.metrics = metric_names()
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
        _refuse_packing(kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths = _lengths(kwargs.get("attention_mask"), ids if ids is not None else kwargs["inputs_embeds"])
        labels, num_items = self._stash.pop("labels", None), self._stash.pop("num_items", None)
        responses = None if labels is None else (labels[:, 1:] >= 0).sum(1)
        scaled = labels is not None and self.weights is not None
        if scaled:
            loss, tokens = self.loss_name, loss_tokens(labels, *self.weights)
        else:  # which tokens carry loss is not known here: every sample is reduced, unscaled
            loss, tokens = UNKNOWN, lengths - 1
        scale = self._scale(tokens, num_items) if scaled else None
        capture = BatchCapture(self.targets, BatchLayout(lengths, lengths.device), self.backend, None, self.metrics,
                               scale)
        self._stack.enter_context(attached(self.model, [capture]))
        self.captures.append(_Captured(capture, loss, tokens, responses, scaled))

    def _scale(self, tokens: torch.Tensor, num_items: torch.Tensor | int | None) -> torch.Tensor:
        """N / n_i: from each sample's share of the step's loss to the loss of the sample alone."""
        if num_items is None:  # the model's mean over this micro-batch; Trainer divides it by the accumulation steps
            total = tokens.sum().double() * self.accumulation
        else:  # over the global batch's tokens; Trainer multiplied the loss by the processes under DDP
            total = torch.as_tensor(num_items, device=tokens.device).double() / self.processes
        return torch.where(tokens > 0, total / tokens.clamp_min(1), 0.0)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.captures:
            return
        rows = []
        for micro_batch, captured in enumerate(self.captures):
            capture, tokens = captured.capture, captured.tokens.cpu()
            capture.to_host()
            flags: list[set[str]] = [set() if n > 0 else {"no_loss_tokens"} for n in tokens.tolist()]
            metrics, _ = capture.reduce(tokens > 0, flags, keep_spectra=False)
            for i in range(len(tokens)):
                row = {"step": state.global_step, "micro_batch": micro_batch, "row": i, "loss": captured.loss,
                       "num_tokens": int(capture.lengths[i]),
                       "num_response_tokens": None if captured.responses is None else int(captured.responses[i]),
                       "num_loss_tokens": int(tokens[i]) if captured.scaled else None,
                       "scaled": captured.scaled, "status": ";".join(sorted(flags[i])) or "ok"}
                rows.append({**row, **metric_columns(metrics, i, self.metrics)})
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


def model_loss(model: nn.Module) -> tuple[str, tuple[float, float] | None]:
    """The loss the model computes when called with labels: its name and its token weights
    (prompt, response); None where the monitor does not know how it weighs tokens."""
    loss_function = getattr(model, "loss_function", None)
    wit = getattr(loss_function, "__self__", None)
    if isinstance(wit, WITLoss):
        return f"wit(lp={wit.prompt_weight:g},lr={wit.response_weight:g})", (wit.prompt_weight, wit.response_weight)
    if loss_function is ForCausalLMLoss:
        return "ntp", (0.0, 1.0)
    return UNKNOWN, None


def loss_tokens(labels: torch.Tensor, prompt_weight: float, response_weight: float) -> torch.Tensor:
    """n_i, each sample's own denominator: its targets whose weight is not zero (WIT's
    1[lp != 0] |P_i| + 1[lr != 0] |R_i|; prompt targets are encoded as -(id + PROMPT_OFFSET))."""
    target = labels[:, 1:]
    weighted = ((target <= -PROMPT_OFFSET) & (prompt_weight != 0)) | ((target >= 0) & (response_weight != 0))
    return weighted.sum(1)


def _refuse_checkpointing(args, model: nn.Module) -> None:
    """A checkpointed forward runs again inside the backward, and the hooks would capture it twice."""
    places = [place for place, on in (
        ("in TrainingArguments", getattr(args, "gradient_checkpointing", False)),
        ("in the model (model.gradient_checkpointing_disable())",
         any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())),
    ) if on]
    if places:
        raise ValueError(f"SpectralMonitor reads activations from the forward pass: gradient checkpointing is on "
                         f"{' and '.join(places)}; turn it off")


def _refuse_packing(kwargs: dict[str, Any]) -> None:
    """A packed row holds several samples; the monitor's rows are one sample each."""
    packing = [k for k in PACKING_KWARGS if kwargs.get(k) is not None]
    positions = kwargs.get("position_ids")
    if positions is not None and _restarts(positions, kwargs.get("attention_mask")):
        packing.append("position_ids restarting within a row")
    if packing:
        raise ValueError(f"SpectralMonitor needs one sample per row, right-padded: packed batches "
                         f"({', '.join(packing)}) are not supported")


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


def _summary(rows: list[dict[str, Any]], targets) -> dict[str, float]:
    """Mean over samples and layers of nuclear norm and effective rank, per module role."""
    out: dict[str, list[float]] = {}
    for t in targets:
        for part in t.parts:
            for metric in ("nuclear_norm", "effective_rank"):
                values = [r[column(part.name, metric)] for r in rows]
                out.setdefault(f"spectra/{part.role}/{metric}", []).extend(v for v in values if math.isfinite(v))
    return {k: sum(v) / len(v) for k, v in out.items() if v}
