"""SpectralMonitor as a transformers Trainer callback (TRL's SFTTrainer too): a thin layer over the
loop-independent monitor (gradspec.training.monitor), which holds what a row means.

A monitored step is one whose number (1, 2, ...) is a multiple of ``every``, so rows land on the
steps Trainer logs at with ``logging_steps = every``. Trainer reports no exception to its callbacks
(no on_train_end when train() raises), so the hooks are on the model only inside Trainer's
``training_step`` (one micro-batch's forward and backward), which the callback wraps on the Trainer
that runs it: however the step is left (its loss or backward raising, KeyboardInterrupt), the model
is left as it was found. Where no Trainer runs the callback (a loop calling its events), hooks go on
at the step's start and off before the optimizer step, and a step left by an exception keeps them
until the next grad-enabled forward, which removes them. A step's rows are written at its end (a part
of ``<out>.parts/``, compacted into out at the training's end) and their per-role means added to the
log record of that step. DataParallel is refused at
``on_train_begin``. Packed and padding-free batches (TRL's ``packing``, ``padding_free``;
DataCollatorWithFlattening) give one row per packed sequence.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from gradspec.training.monitor import COMPILED, SpectralMonitor

if TYPE_CHECKING:
    from transformers import Trainer


class SpectralMonitorCallback(TrainerCallback):
    """Rows of every N-th optimizer step to ``out`` (Parquet), per-role means to the logs.

    Args:
        every: Monitor every N-th optimizer step (set ``logging_steps`` to it, so rows land on logged steps).
        modules: What to score, as for SpectralEngine.
        out: The Parquet file: a part per monitored step in ``<out>.parts/``, compacted into out at the
            training's end (SpectralMonitor); None: logs only.
        backend: "auto", "cpp" or "torch", as for SpectralEngine.
        overwrite: Overwrite an existing ``out`` (else a ValueError at the run's first monitored step).
        index_column: A batch column of dataset indices (remove_unused_columns=False, a collator
            that passes it): taken out of monitored calls into sample_index, out of the others'
            batches (the model never sees it). None: none.
    """

    def __init__(self, every: int = 50, modules: str | list[str] = "attn", out: str | Path | None = None,
                 backend: str = "auto", overwrite: bool = False, index_column: str | None = "sample_index") -> None:
        self.monitor = SpectralMonitor(every, modules, out, backend, overwrite, index_column)
        self.pending_logs: dict[str, float] = {}
        self.guarded = False  # whether the running Trainer's training_step puts the hooks on (_guard_training_step)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """A new run: a new file (a resumed run: the rows up to its checkpoint kept); refuses DataParallel;
        reads the accumulation, processes and loss type;
        wraps the running Trainer's training_step (_guard_training_step).

        Args:
            args: Trainer's TrainingArguments.
            state: Trainer's TrainerState: a resumed run's global_step is its checkpoint's.
            control: Trainer's TrainerControl (unused).
            model: The model Trainer trains, hooked on monitored steps.
        """
        # a new run: hooks a raised run left are gone, a new file; a run resumed from a checkpoint (Trainer has
        # loaded its state: global_step > 0) keeps the file's rows up to that step
        self.monitor.restart(resumed_at=state.global_step or None)
        refuse_unmonitorable(args)
        self.model = model
        self.accumulation = args.gradient_accumulation_steps
        self.processes = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        # TRL's loss_type other than nll (dft, ...) weighs tokens as the model's loss does not
        self.loss_known = getattr(args, "loss_type", "nll") in ("nll", None)
        trainer = _running_trainer(self)
        self.guarded = trainer is not None
        if trainer is not None:
            _guard_training_step(trainer, self.monitor)
            _log_summaries(trainer, self)

    def on_step_begin(self, args, state, control, **kwargs):
        """A monitored step begins: its hooks go on in each guarded training_step (else now).

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState: global_step + 1 is this step's number.
            control: Trainer's TrainerControl (unused).
        """
        step = state.global_step + 1
        if self.monitor.wants(step):
            self.monitor.begin(self.model, step, self.accumulation, self.processes, loss_known=self.loss_known,
                               most=self.accumulation, attach=not self.guarded)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Hooks off: every micro-batch's backward has run.

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState (unused).
            control: Trainer's TrainerControl (unused).
        """
        self.monitor.detach()  # every micro-batch's backward has run: nothing stays on the model

    def on_step_end(self, args, state, control, **kwargs):
        """Writes a monitored step's rows and keeps their per-role means for the next log.

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState (unused).
            control: Trainer's TrainerControl (unused).
        """
        if self.monitor.active:
            self.monitor.end()
            self.pending_logs = dict(self.monitor.summary)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Adds the latest summaries to the log record, where no Trainer's log carried them already
        (_log_summaries): callbacks after this one see them.

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState: its log_history's record of this step gets them too.
            control: Trainer's TrainerControl (unused).
            logs: The record being logged, updated in place.
        """
        if logs is not None and self.pending_logs:
            logs.update(self.pending_logs)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending_logs)
            self.pending_logs = {}

    def on_train_end(self, args, state, control, **kwargs):
        """Hooks off, an unfinished step's captures dropped, the run's parts compacted into out (close).

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState (unused).
            control: Trainer's TrainerControl (unused).
        """
        self.monitor.close()


def _guard_training_step(trainer: Trainer, monitor: SpectralMonitor) -> None:
    """The trainer's training_step (one micro-batch's forward and backward), wrapped on the instance so
    that the monitor's hooks are on the model inside it alone (SpectralMonitor.hooked): taken off
    however the step is left, which no callback can do (Trainer tells them of no exception). Once
    per trainer and monitor (a later train() finds it wrapped); outside a monitored step it calls through,
    the batch's index column taken out (on monitored steps the monitor's hooks take it), so that a model
    whose forward takes no **kwargs trains as well.

    Args:
        trainer: The transformers Trainer (or subclass: TRL's SFTTrainer, ...) whose steps are monitored.
        monitor: The monitor whose hooks the steps carry.
    """
    def wrap(step):
        def training_step(*args, **kwargs):
            if not monitor.active and monitor.index_column:  # (model, inputs, num_items_in_batch)
                if isinstance(kwargs.get("inputs"), Mapping):
                    kwargs["inputs"] = _without(kwargs["inputs"], monitor.index_column)
                elif len(args) > 1 and isinstance(args[1], Mapping):
                    args = (args[0], _without(args[1], monitor.index_column), *args[2:])
            with monitor.hooked():
                return step(*args, **kwargs)
        return training_step

    _wrap_once(trainer, "training_step", monitor, wrap)


def _log_summaries(trainer: Trainer, callback: SpectralMonitorCallback) -> None:
    """The trainer's log, wrapped on the instance so that the monitor's latest per-role means join the
    record before any callback sees it: report_to's trackers (TensorBoard, W&B, trackio) are Trainer's
    callbacks, called before a user's, so a record extended in on_log would reach none of them. Once
    per trainer and callback."""
    def wrap(log):
        def logged(logs, *args, **kwargs):
            if callback.pending_logs and not any(key.startswith("eval_") for key in logs):
                logs = {**logs, **callback.pending_logs}
                callback.pending_logs = {}
            return log(logs, *args, **kwargs)
        return logged

    _wrap_once(trainer, "log", callback, wrap)


def _wrap_once(trainer: Trainer, name: str, owner: object, wrap: Callable[[Callable], Callable]) -> None:
    """The trainer's method `name` replaced on the instance by wrap(method), once per trainer and owner: a
    later train() finds it wrapped, under another owner's wrapper or not."""
    method = getattr(trainer, name)
    if getattr(inspect.unwrap(method, stop=lambda f: getattr(f, "gradspec_monitor", None) is owner),
               "gradspec_monitor", None) is owner:
        return
    wrapped = functools.wraps(method)(wrap(method))
    wrapped.gradspec_monitor = owner
    setattr(trainer, name, wrapped)


def _without(inputs: Mapping, column: str) -> Mapping:
    return {k: v for k, v in inputs.items() if k != column} if column in inputs else inputs


def _running_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose event calls the callback (callbacks are not given it): the nearest caller
    whose self is a Trainer holding this callback; None where no Trainer runs it."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame held here would keep every caller's locals alive


def refuse_unmonitorable(args) -> None:
    """A ValueError before the first step for what the monitor cannot capture."""
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError("SpectralMonitor hooks one model copy: DataParallel (n_gpu > 1) is not supported; "
                         "run one process per device (torchrun)")
    if getattr(args, "torch_compile", False):
        raise ValueError(f"{COMPILED}: train with torch_compile=False to monitor it")
