"""Live spectral monitor, for any training loop: per-sample gradient spectra of training batches,
from the loop's own forward and backward (hooks, no extra pass), every N optimizer steps.

    monitor = SpectralMonitor(every=50, out="monitor.parquet")
    with monitor.step(model):          # or SpectralMonitorCallback for transformers' Trainer
        model(**batch).loss.backward()

What a row is. The step backpropagates L = sum_i l_i / N, where l_i is sample i's summed
(weighted) token loss and N the loss's denominator, so each hooked module sees, per sample, the
output gradient of l_i / N. The monitor multiplies it by N / n_i, n_i the sample's own
denominator: a row holds the spectrum of d(l_i / n_i)/dW, the gradient of the loss of sample i
trained alone, whichever batch, accumulation split or number of processes it came in. Its
``loss_kind`` column says which loss, and ``loss`` is that loss's value, l_i / n_i:

- ``ntp``, the model's own causal-LM loss: l_i = sum of the cross-entropy over its labelled
  (response) tokens, n_i their count (``num_loss_tokens``): the gradient of the sample's mean
  response loss, so rows equal ``gradspec score`` on the same batch and weights, ``loss`` included.
- ``wit(lp=..,lr=..)``, WIT installed with ``use_wit_loss``: l_i = lp * sum over its prompt
  tokens + lr * sum over its response tokens, n_i = 1[lp != 0] |P_i| + 1[lr != 0] |R_i|.
- ``unknown``: the loop computes the loss itself (SFTMix, a ``compute_loss_func``, labels kept out
  of the model call), or the model's loss function is neither of the above: rows hold each
  sample's share of the step's gradient as it is (``scaled`` false, ``loss`` null).

N is ``num_items_in_batch`` where the model call gets it (Trainer: the labelled tokens of the whole
accumulated batch, over all processes with ``average_tokens_across_devices``; ``processes`` divides
out the factor Trainer then multiplies the loss by); otherwise the micro-batch's own count times
``accumulation`` (the loop divides a mean loss by its accumulation steps).

Columns: step, micro_batch, row, sample_index (the dataset index, where the loop gives it: an
``index_column`` in the batch, popped before the model sees it, or ``indices``), loss, loss_kind,
num_tokens, num_response_tokens (null without labels in the model call), num_loss_tokens (n_i;
null where not scaled), scaled, status (``no_loss_tokens`` where n_i = 0: no metrics), then every
module's metrics.

Capture. Hooks are on the model from ``begin`` to ``detach``: through the backward, so that under
activation checkpointing each module's input is taken from its recomputed forward
(``gradspec.layers.checkpointing``), and each input's eigen stage runs as soon as the input is
gone, so the fp64 Grams of about one layer are held, not the whole step's (``eager``: memory is
what checkpointing buys; without it each micro-batch's eigen stage runs when the next forward begins,
or at the step's end, so one micro-batch's Grams are held at a time). Each grad-enabled
forward is one micro-batch; its backward
must run before the next forward under checkpointing. An exception inside ``step`` removes every
hook and drops that step's rows.

Output. Each monitored step's rows go out at its end as one Parquet part of ``<out>.parts/``
(``gradspec.training.monitor_parts``), written aside and renamed: a run killed at any moment keeps
every step before the one it cut, readable with ``read_monitor``, and each step costs one small write
however long the run, with no earlier row held in memory. ``close`` (Trainer: the callback at the
training's end) compacts the parts into ``out``, one file, as before.

Packed and padding-free batches (sequences delimited by position ids that restart within a row, or
by flash attention's ``cu_seq_lens``): one row per packed sequence, its tokens gathered from the
packed rows (``gradspec.layers.hooks.PackedLayout``); each sequence's first label must be -100, as
DataCollatorWithFlattening makes it. Whether the sequences attend to each other is the model's
attention's business (flash attention with cu_seq_lens, or an explicit block-diagonal mask,
isolates them; sdpa and eager with position ids alone do not), and the rows are the gradients of
what it computed. Refused with a ValueError: left-padded rows.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import torch
import torch.distributed as dist
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from gradspec.data.errors import check_parquet_out
from gradspec.data.templates import IGNORE_INDEX
from gradspec.engine.capture import BatchCapture
from gradspec.engine.loss import next_token_nll
from gradspec.layers.hooks import BatchLayout, PackedLayout, attached, token_mask
from gradspec.layers.targets import select_targets
from gradspec.linalg.metrics import metric_names
from gradspec.linalg.policy import Policy
from gradspec.runs.score_files import column, metric_columns
from gradspec.training.monitor_parts import MonitorParts, parts_folder
from gradspec.training.wit import WITLoss, next_token_targets

log = logging.getLogger("gradspec")
COMPILED = "SpectralMonitor cannot hook a torch.compile'd model (its graph skips hooks added later)"
UNKNOWN = "unknown"
COLUMN_TYPES = {  # the rest are metrics, float64
    "step": pa.int64(), "micro_batch": pa.int64(), "row": pa.int64(), "sample_index": pa.int64(), "loss": pa.float64(),
    "loss_kind": pa.string(), "num_tokens": pa.int64(), "num_response_tokens": pa.int64(),
    "num_loss_tokens": pa.int64(), "scaled": pa.bool_(), "status": pa.string(),
}


class _MonitorCapture(BatchCapture):
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
        self.x_grams = {}
        log.warning("SpectralMonitor: this micro-batch's spectra are dropped (%s); training goes on", self.failed)


class _MicroBatch(NamedTuple):
    capture: _MonitorCapture
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


class _Step(NamedTuple):
    step: int
    model: nn.Module
    accumulation: int
    processes: int
    num_items: torch.Tensor | int | None
    indices: list[int] | None
    loss_known: bool
    most: int | None  # micro-batches the step can have (a callback's steps); more: a step an exception left


class SpectralMonitor:
    """Per-sample gradient spectra of a training loop's own passes; rows go to ``out`` (Parquet).

    Args:
        every: Monitor the optimizer steps whose number (1, 2, ...) is a multiple of this.
        modules: What to score, as for SpectralEngine: a preset, role names or part-name globs.
        out: The Parquet file: each monitored step's rows go to a part of ``<out>.parts/`` at its end,
            compacted into out by ``close`` (under torch.distributed, one per rank: out's name with
            .rank<r> before its suffix); None: rows are only returned by end() (and summarised).
        backend: "auto", "cpp" or "torch", as for SpectralEngine.
        overwrite: Overwrite an existing ``out`` or its parts (else a ValueError at a run's first monitored
            step).
        index_column: A keyword of the model call holding each row's dataset index: popped from
            monitored calls (the model never sees it there) into the sample_index column; None: none.
    """

    def __init__(self, every: int = 50, modules: str | list[str] = "attn", out: str | Path | None = None,
                 backend: str = "auto", overwrite: bool = False, index_column: str | None = "sample_index") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: a whole number of steps, at least 1; got {every!r}")
        if out is not None:
            check_parquet_out(out, "out")
        Policy.of(backend)  # an unknown backend is named now, not at the first monitored step
        self.every, self.modules, self.backend = every, modules, backend
        self.out, self.overwrite, self.index_column = None if out is None else Path(out), overwrite, index_column
        self.summary: dict[str, float] = {}  # per-role means of the last step's rows
        self._steps = 0  # steps seen by step() without a number
        self._parts: MonitorParts | None = None  # <out>.parts/, held from a run's first monitored step to close
        self._started = False
        # a resumed run's checkpoint step: the rows up to it are kept (inf: all, steps after a close go on)
        self._resumed_at: float | None = None
        self._targets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its targets
        self._current: _Step | None = None
        self._stash: dict[str, Any] = {}  # what the model call passed, for its base model's forward
        self._micro: list[_MicroBatch] = []
        self._handles: list = []  # the model's own hooks of the current step (before and after its forward)
        self._layer_hooks = ExitStack()  # the current micro-batch's layer hooks

    @property
    def active(self) -> bool:
        """Whether a monitored step is under way (between begin and end)."""
        return self._current is not None

    def wants(self, step: int) -> bool:
        """Whether optimizer step `step` (1, 2, ...) is monitored: every N-th.

        Args:
            step: The optimizer step's number, from 1.

        Returns:
            True where step is a multiple of ``every``.
        """
        return step % self.every == 0

    @contextmanager
    def step(self, model: nn.Module, step: int | None = None, *, num_items_in_batch: torch.Tensor | int | None = None,
             accumulation: int = 1, processes: int = 1, indices: Sequence[int] | None = None) -> Iterator[None]:
        """One optimizer step's forwards and backwards, captured where the step is monitored (step:
        its number, 1, 2, ...; by default the count of calls). indices: the dataset index of each
        row, over the step's micro-batches in order. On exit the rows are reduced and written; an
        exception removes the hooks and drops the step's rows.

        Args:
            model: The model the loop calls; hooks go on it and on its ``base_model``, if any.
            step: The optimizer step's number, from 1; None: one more than the last step's.
            num_items_in_batch: The step's loss denominator N where the model call does not pass it
                (the labelled tokens of the whole accumulated batch); None: each micro-batch's own
                count times ``accumulation``.
            accumulation: Micro-batches per optimizer step, where the loop divides a mean loss by them.
            processes: The factor the loss is multiplied by across processes (Trainer under DDP with
                average_tokens_across_devices: the world size); it divides N.
            indices: The dataset index of each row (each packed sequence), over the step's
                micro-batches in order; for batches without ``index_column``.

        Yields:
            Nothing: the loop's forwards and backwards run inside.
        """
        self._steps = self._steps + 1 if step is None else step
        if not self.wants(self._steps):
            yield
            return
        self.begin(model, self._steps, accumulation, processes, num_items_in_batch, indices)
        try:
            yield
        except BaseException:
            self.abort()
            raise
        self.end()

    # The steps of ``step``, for callbacks that see a step's start and end as separate events.

    def begin(self, model: nn.Module, step: int, accumulation: int = 1, processes: int = 1,
              num_items_in_batch: torch.Tensor | int | None = None, indices: Sequence[int] | None = None,
              loss_known: bool = True, most: int | None = None, attach: bool = True) -> None:
        """A monitored step begins; hooks on the model: each grad-enabled forward from now on is a
        captured micro-batch. loss_known=False: the trainer's loss is not the model's (rows unscaled,
        loss_kind unknown). most: the micro-batches a step has at most; a forward beyond them means
        the step was left by an exception the caller could not see (a trainer's backward): the hooks
        come off then. attach=False: no hook yet; ``hooked`` puts them on around each micro-batch.

        Args:
            model: The model the loop calls, as for step.
            step: The optimizer step's number, recorded in the rows.
            accumulation: As for step.
            processes: As for step.
            num_items_in_batch: As for step.
            indices: As for step.
            loss_known: False where the trainer's loss is not the model's.
            most: The step's micro-batches at most; None: no limit.
            attach: False: the hooks go on only inside ``hooked`` (a trainer's guarded training step).
        """
        self.abort()
        model = monitored_model(model)
        if not self._started:
            self._start()
        if model not in self._targets:
            self._targets[model] = select_targets(model, self.modules)
        self._current = _Step(step, model, accumulation, processes, num_items_in_batch,
                              None if indices is None else [int(i) for i in indices], loss_known, most)
        if attach:
            self._attach()

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """The current step's hooks on the model inside the block alone (a trainer's training step: one
        micro-batch's forward and backward), off however the block is left, so that no exception the
        trainer keeps from its callbacks leaves them on; an exception also drops the step. Outside a
        monitored step: nothing.

        Yields:
            Nothing: the micro-batch's forward and backward run inside.
        """
        if self._current is None:
            yield
            return
        if not self._handles:
            self._attach()
        try:
            yield
        except BaseException:
            self.abort()
            raise
        self.detach()  # its backward has run; its captures are kept for end()

    def _attach(self) -> None:
        """The current step's own hooks on its model (and base model): micro-batches start from them."""
        model = self._current.model
        base = getattr(model, "base_model", model)
        self._handles = [model.register_forward_hook(self._call_ends, always_call=True),
                         base.register_forward_pre_hook(self._forward_begins, with_kwargs=True)]
        if base is not model:
            self._handles += [model.register_forward_pre_hook(self._call_begins, with_kwargs=True),
                              base.register_forward_hook(self._call_ends, always_call=True)]

    def detach(self) -> None:
        """Every hook off the model (the step's backward is done); its captures are kept for end()."""
        self._layer_hooks.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def end(self) -> list[dict[str, Any]]:
        """Reduces the step's captures to rows, writes them and returns them.

        Returns:
            The step's rows, one per sample (a row, or a packed sequence) of each micro-batch, as
            the file's columns; ``summary`` then holds their per-role means.
        """
        try:
            self.detach()
            rows = self._rows()
            self.summary = _summary(rows, self._targets[self._current.model]) if self._current else {}
            if rows and self.out is not None:
                try:
                    self._write(rows)
                except OSError as error:  # a full disk must not end the training: the rows are still returned
                    log.error("SpectralMonitor: step %s's rows not written to %s (%s)", rows[0]["step"],
                              parts_folder(self.out), error)
            return rows
        finally:
            self._current, self._micro = None, []

    def abort(self) -> None:
        """Hooks off and the current step's captures dropped."""
        self.detach()
        self._current, self._micro = None, []

    def close(self) -> None:
        """The run's end: hooks off, an unfinished step's captures dropped, and the parts written so far
        compacted into ``out``, one file (a resumed run that monitored no step since: its rows up to the
        checkpoint). Steps after it continue that file. A compaction that fails (a full disk) is logged,
        and the parts stay, readable with read_monitor."""
        self.abort()
        if self.out is None:
            return
        if not self._started:
            if self._resumed_at is None or math.isinf(self._resumed_at):  # no step of this run: nothing of its own
                return
            self._start()
        try:
            self._parts.compact()
        except (OSError, ValueError, pa.ArrowException) as error:  # the training is done: its rows stay in the parts
            log.error("SpectralMonitor: the parts in %s not compacted into %s (%s); read them with read_monitor",
                      self._parts.path, self.out, error)
        finally:
            self._started, self._resumed_at = False, math.inf

    def _start(self) -> None:
        """A run's first monitored step: new parts, an existing file or parts refused unless overwrite (then
        removed); a resumed run's rows up to its checkpoint kept. Under torch.distributed with several
        processes each rank writes its own file and parts (out's name with .rank<r> before its suffix):
        every rank sees its own micro-batches."""
        if self.out is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank = f".rank{dist.get_rank()}"
            if not self.out.stem.endswith(rank):
                self.out = self.out.with_name(f"{self.out.stem}{rank}{self.out.suffix}")
        if self.out is not None:  # a resumed run's rows up to its checkpoint go on; later ones are trained again
            self._parts = MonitorParts(self.out)
            self._parts.open(self.overwrite, self._resumed_at)
            weakref.finalize(self, self._parts.release)  # a monitor dropped unclosed holds its folder no longer
        self._started = True

    def restart(self, resumed_at: int | None = None) -> None:
        """A new run: the next monitored step starts new parts (refusing an existing file or parts); a run
        resumed from a checkpoint at step resumed_at keeps the rows up to that step instead.

        Args:
            resumed_at: The step of the checkpoint a resumed run continues from; None: a new run.
        """
        self.abort()
        if self._parts is not None:  # a run not closed: its parts stay, its lock goes
            self._parts.release()
        self._started, self._resumed_at = False, resumed_at

    def _call_begins(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The model call: its labels, denominator and dataset indices, for the base model's forward."""
        indices = kwargs.pop(self.index_column, None) if self.index_column else None
        if torch.is_grad_enabled() and self._current is not None:
            self._stash = {"labels": kwargs.get("labels"), "num_items": kwargs.get("num_items_in_batch"),
                           "indices": indices}
        return (args, kwargs) if indices is not None else None

    def _forward_begins(self, base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The base model's forward: a micro-batch starts (also where a trainer calls the base alone)."""
        if self._current is None:
            return None
        headless = base is self._current.model  # one call: stash and start
        if headless:
            popped = self._call_begins(base, args, kwargs)
            args, kwargs = popped if popped is not None else (args, kwargs)
        if not torch.is_grad_enabled():
            return (args, kwargs) if headless else None
        stash, self._stash = self._stash, {}
        if self._current.most is not None and len(self._micro) >= self._current.most:
            log.warning("SpectralMonitor: step %d has more forwards than its %d micro-batches; taking it for a "
                        "step an exception left, its hooks off and its rows dropped", self._current.step,
                        self._current.most)
            self.abort()
            return (args, kwargs) if headless else None
        self._layer_hooks.close()  # the previous micro-batch's backward has run
        if self._micro:  # its eigen stage now: one micro-batch's Grams held at a time, not the step's
            self._reduce(self._micro[-1])
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens_in = ids if ids is not None else kwargs["inputs_embeds"]
        labels, indices = stash.get("labels"), stash.get("indices")
        sequences = packed_sequences(kwargs, tokens_in.shape[:2])
        if sequences is None:  # one sample per row, right-padded
            lengths = _lengths(kwargs.get("attention_mask"), tokens_in)
            layout, own_labels = BatchLayout(lengths, lengths.device), labels
            owner = torch.arange(len(lengths), device=tokens_in.device)[:, None].expand(tokens_in.shape[:2])
        else:  # one sample per packed sequence
            layout = PackedLayout(sequences, tuple(tokens_in.shape[:2]), tokens_in.device)
            lengths, owner = layout.lengths, layout.owner
            own_labels = None if labels is None else _sequence_labels(labels, layout)
        num_items = stash.get("num_items") if stash.get("num_items") is not None else self._current.num_items
        kind, weights = model_loss(self._current.model) if self._current.loss_known else (UNKNOWN, None)
        scaled = labels is not None and weights is not None
        tokens = loss_tokens(own_labels, *weights) if scaled else lengths.to(tokens_in.device) - 1
        sample_indices = [None] * len(lengths) if indices is None else \
            [int(i) for i in torch.as_tensor(indices).tolist()]
        if len(sample_indices) != len(lengths):
            raise ValueError(f"SpectralMonitor: {self.index_column} has {len(sample_indices)} entries for this "
                             f"batch's {len(lengths)} samples (a packed batch: one per sequence)")
        if indices is None and self._current.indices is not None:
            done = sum(len(m.indices) for m in self._micro)
            sample_indices = (self._current.indices[done : done + len(lengths)] + sample_indices)[: len(lengths)]
        model = self._current.model
        capture = _MonitorCapture(self._targets[model], layout, self.backend, None,
                                  metric_names(), self._scale(tokens, num_items) if scaled else None)
        self._layer_hooks.enter_context(attached(model, [capture]))
        self._micro.append(_MicroBatch(capture, kind if scaled else UNKNOWN, tokens,
                                       None if labels is None else (own_labels[:, 1:] >= 0).sum(1), scaled,
                                       sample_indices, labels, owner, weights, [], []))
        return (args, kwargs) if headless else None

    def _call_ends(self, model: nn.Module, args: tuple, output: Any) -> None:
        """Each sample's loss value, from the logits (or a fused head's per-token log-probabilities)."""
        if self._current is None:
            return
        if output is None:  # the forward raised: nothing of this step is kept, no hook stays
            self._abort_within_forward(model)
            return
        if not torch.is_grad_enabled() or not self._micro:
            return
        micro = self._micro[-1]
        if not micro.scaled or micro.losses:
            return
        try:
            self._losses_of(micro, output)
        except Exception as error:  # noqa: BLE001 - out of memory gathering the logits must not end the step
            micro.capture.fail(error)

    @staticmethod
    def _losses_of(micro: _MicroBatch, output: Any) -> None:
        logits, log_probs = getattr(output, "logits", None), getattr(output, "log_probs", None)
        with torch.no_grad():
            if isinstance(logits, torch.Tensor) and logits.shape[:2] == micro.labels.shape:
                micro.losses.append(sample_losses(logits.detach(), micro.labels, *micro.weights, micro.owner,
                                                  micro.tokens))
            elif isinstance(log_probs, torch.Tensor) and micro.weights == (0.0, 1.0) \
                    and log_probs.shape == micro.labels[:, 1:].shape:  # TRL's fused head: zero off the labels
                total = torch.zeros(len(micro.tokens), dtype=torch.float64, device=log_probs.device)
                total.index_add_(0, micro.owner[:, 1:].flatten(), -log_probs.detach().double().flatten())
                micro.losses.append(total / micro.tokens.double())

    def _abort_within_forward(self, module: nn.Module) -> None:
        """abort() from a forward hook while torch, unwinding the forward's exception, iterates the
        module's live hook dict: the hooks on it leave by a new dict instead of a deletion."""
        mine = {h.id for h in self._handles}
        hooks = module._forward_hooks
        module._forward_hooks = type(hooks)((k, v) for k, v in hooks.items() if k not in mine)
        for k in mine:
            module._forward_hooks_always_called.pop(k, None)
        self._handles = [h for h in self._handles if h.id not in hooks]
        self.abort()

    def _scale(self, tokens: torch.Tensor, num_items: torch.Tensor | int | None) -> torch.Tensor:
        """N / n_i: from each sample's share of the step's loss to the loss of the sample alone."""
        if num_items is None:  # the model's mean over this micro-batch, divided by the accumulation steps
            total = tokens.sum().double() * self._current.accumulation
        else:  # over the global batch's tokens, the loss multiplied by the processes (Trainer under DDP)
            total = torch.as_tensor(num_items, device=tokens.device).double() / self._current.processes
        return torch.where(tokens > 0, total / tokens.clamp_min(1), 0.0)

    @staticmethod
    def _reduce(micro: _MicroBatch) -> None:
        """A micro-batch's eigen stage (once its backward has run), its metrics and flags kept, its Grams freed."""
        if micro.reduced:
            return
        capture, tokens = micro.capture, micro.tokens.cpu()
        capture.to_host()
        flags: list[set[str]] = [set() if n > 0 else {"no_loss_tokens"} for n in tokens.tolist()]
        scored = tokens > 0
        if capture.failed is not None:  # no part's spectra: NaN, flagged once, not each part as missing
            flags, scored = [f | {"monitor_failed"} for f in flags], torch.zeros_like(scored)
        metrics, _ = capture.reduce(scored, flags, keep_spectra=False)
        capture.release()
        micro.reduced.append((metrics, flags))

    def _rows(self) -> list[dict[str, Any]]:
        rows, names = [], metric_names()
        for micro_batch, micro in enumerate(self._micro):
            self._reduce(micro)
            (metrics, flags), capture, tokens = micro.reduced[0], micro.capture, micro.tokens.cpu()
            losses = micro.losses[0].cpu().tolist() if micro.losses else [None] * len(tokens)
            for i in range(len(tokens)):
                loss = losses[i] if tokens[i] > 0 else None
                if loss is not None and not math.isfinite(loss):
                    flags[i].add("nonfinite_loss")
                row = {"step": self._current.step, "micro_batch": micro_batch, "row": i,
                       "sample_index": micro.indices[i], "loss": loss, "loss_kind": micro.loss_kind,
                       "num_tokens": int(capture.lengths[i]),
                       "num_response_tokens": None if micro.responses is None else int(micro.responses[i]),
                       "num_loss_tokens": int(tokens[i]) if micro.scaled else None,
                       "scaled": micro.scaled, "status": ";".join(sorted(flags[i])) or "ok"}
                rows.append({**row, **metric_columns(metrics, i, names)})
        return rows

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """This step's rows as the next part (written aside, then renamed): a kill loses at most this step,
        and the cost stays one step's whatever the run's length. Parts of other columns (a resumed run's
        other modules) are joined by whoever reads them."""
        schema = pa.schema([(name, COLUMN_TYPES.get(name, pa.float64())) for name in rows[0]])  # typed if all null
        table = pa.Table.from_pylist(rows, schema=schema)
        self._parts.write(table)


def monitored_model(model: nn.Module) -> nn.Module:
    """The module whose calls the monitor hooks: a DDP-wrapped model's own module (DDP calls it with the
    batch; the wrapper has neither the loss nor the config the rows need). A compiled model is refused:
    its graph skips hooks added after compilation (no rows), or fails on them inside the step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(f"{COMPILED}: monitor the model uncompiled (Trainer: torch_compile=False)")
    return model


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
    return (next_token_targets(labels, prompt_weight, response_weight)[1] != 0).sum(1)


LOSS_CHUNK_BYTES = 256 * 2**20  # the fp32 logits a loss computes at once


def sample_losses(logits: torch.Tensor, labels: torch.Tensor, prompt_weight: float, response_weight: float,
                  owner: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """l_i / n_i per sample (NaN where n_i = 0), in fp32, a few rows at a time: no fp32 copy of the whole
    batch's logits, and nothing read on the host. owner (rows, T): the sample each position belongs to
    (a row, or a packed sequence); tokens: n_i."""
    ids, weights = next_token_targets(labels, prompt_weight, response_weight)
    owner = torch.nn.functional.pad(owner[:, 1:], (0, 1))  # each target's sample (the last position: no target)
    total = torch.zeros(len(tokens), device=logits.device)
    rows = max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[1] * logits.shape[2]))
    for start in range(0, len(logits), rows):
        part = slice(start, start + rows)
        nll = next_token_nll(logits[part].flatten(0, 1), ids[part].flatten()) * weights[part].flatten()
        total.index_add_(0, owner[part].flatten(), nll)
    return total.double() / tokens.double()


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


def _summary(rows: list[dict[str, Any]], targets) -> dict[str, float]:
    """Mean over samples and layers of nuclear norm and effective rank, per module role."""
    out: dict[str, list[float]] = {}
    for t in targets:
        for part in t.parts:
            for metric in ("nuclear_norm", "effective_rank"):
                values = [r[column(part.name, metric)] for r in rows]
                out.setdefault(f"spectra/{part.role}/{metric}", []).extend(v for v in values if math.isfinite(v))
    return {k: sum(v) / len(v) for k, v in out.items() if v}
