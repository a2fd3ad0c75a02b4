"""Live spectral monitor, for any training loop: per-sample gradient spectra of training batches,
from the loop's own forward and backward (hooks, no extra pass), every N optimizer steps.

    monitor = SpectralMonitor(every=50, out="monitor.parquet")
    with monitor.step(model):          # or SpectralMonitorCallback for transformers' Trainer
        model(**batch).loss.backward()

This module is the hooks' life cycle; the rest of a row's way is in its neighbours. Each grad-enabled
forward is a micro-batch: where its samples are (``monitor_layout``: padded rows or packed sequences,
their labels and dataset indices) and which loss its rows are the gradients of (``monitor_loss``: a
row is the gradient of the loss of its sample trained alone, whichever batch, accumulation split or
number of processes it came in) make its capture (``monitor_batch``); at the step's end its captures
become rows (``monitor_rows``: the columns) and one part of ``<out>.parts/`` (``monitor_parts``).

Capture. Hooks are on the model from ``begin`` to ``detach``: through the backward, so that under
activation checkpointing each module's input is taken from its recomputed forward
(``gradspec.layers.checkpointing``), and each input's eigen stage runs as soon as the input is
gone, so the fp64 Grams of about one layer are held, not the whole step's (``eager``: memory is
what checkpointing buys; without it each micro-batch's eigen stage runs when the next forward begins,
or at the step's end, so one micro-batch's Grams are held at a time). Its backward must run before
the next forward under checkpointing. An exception inside ``step`` removes every hook and drops that
step's rows.

Output. Each monitored step's rows go out at its end as one Parquet part of ``<out>.parts/``
(``gradspec.training.monitor_parts``), written aside and renamed: a run killed at any moment keeps
every step before the one it cut, readable with ``read_monitor``, and each step costs one small write
however long the run, with no earlier row held in memory. ``close`` (Trainer: the callback at the
training's end) compacts the parts into ``out``, one file.

Packed sequences attend to each other or not as the model's attention decides (flash attention with
cu_seq_lens, or an explicit block-diagonal mask, isolates them; sdpa and eager with position ids alone
do not), and the rows are the gradients of what it computed.
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

from gradspec.data.errors import check_parquet_out
from gradspec.layers.hooks import attached
from gradspec.layers.targets import select_targets
from gradspec.linalg.policy import Policy
from gradspec.training.monitor_batch import MicroBatch
from gradspec.training.monitor_layout import dataset_indices, sample_layout
from gradspec.training.monitor_loss import loss_scale, sample_loss
from gradspec.training.monitor_parts import MonitorParts, parts_folder
from gradspec.training.monitor_rows import rows_table, step_rows, summary

log = logging.getLogger("gradspec")
COMPILED = "SpectralMonitor cannot hook a torch.compile'd model (its graph skips hooks added later)"


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
        self._micro: list[MicroBatch] = []
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
            rows = step_rows(self._current.step, self._micro) if self._current else []
            self.summary = summary(rows, self._targets[self._current.model]) if self._current else {}
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
            self._micro[-1].reduce()
        step, labels = self._current, stash.get("labels")
        samples = sample_layout(args, kwargs, labels)
        num_items = stash.get("num_items") if stash.get("num_items") is not None else step.num_items
        loss = sample_loss(step.model, step.loss_known, samples.labels, samples.lengths, samples.device)
        indices = dataset_indices(stash.get("indices"), len(samples.lengths), step.indices,
                                  sum(len(m.indices) for m in self._micro), self.index_column)
        scale = loss_scale(loss.tokens, num_items, step.accumulation, step.processes) if loss.scaled else None
        micro = MicroBatch.start(self._targets[step.model], self.backend, samples, loss, scale, labels, indices)
        self._layer_hooks.enter_context(attached(step.model, [micro.capture]))
        self._micro.append(micro)
        return (args, kwargs) if headless else None

    def _call_ends(self, model: nn.Module, args: tuple, output: Any) -> None:
        """Each sample's loss value, from the logits (or a fused head's per-token log-probabilities)."""
        if self._current is None:
            return
        if output is None:  # the forward raised: nothing of this step is kept, no hook stays
            self._abort_within_forward(model)
            return
        if torch.is_grad_enabled() and self._micro:
            self._micro[-1].record_losses(output)

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

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """This step's rows as the next part (written aside, then renamed): a kill loses at most this step,
        and the cost stays one step's whatever the run's length. Parts of other columns (a resumed run's
        other modules) are joined by whoever reads them."""
        self._parts.write(rows_table(rows))


def monitored_model(model: nn.Module) -> nn.Module:
    """The module whose calls the monitor hooks: a DDP-wrapped model's own module (DDP calls it with the
    batch; the wrapper has neither the loss nor the config the rows need). A compiled model is refused:
    its graph skips hooks added after compilation (no rows), or fails on them inside the step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(f"{COMPILED}: monitor the model uncompiled (Trainer: torch_compile=False)")
    return model
