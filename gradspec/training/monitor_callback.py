"""SpectralMonitor as a transformers Trainer callback (TRL's SFTTrainer too): a thin layer over the
loop-independent monitor (gradspec.training.monitor), which holds what a row means.

A monitored step is one whose number (1, 2, ...) is a multiple of ``every``, so rows land on the
steps Trainer logs at with ``logging_steps = every``. Hooks go on at the step's start and off
before the optimizer step (the backward is done); its rows are written at the step's end and their
per-role means added to the log record of that step. A step left by an exception Trainer does not
report (in its backward) keeps its hooks until the next grad-enabled forward, which removes them.
DataParallel is refused at ``on_train_begin``. Packed and padding-free batches (TRL's ``packing``,
``padding_free``; DataCollatorWithFlattening) give one row per packed sequence.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from gradspec.training.monitor import SpectralMonitor


class SpectralMonitorCallback(TrainerCallback):
    """Rows of every N-th optimizer step to ``out`` (Parquet), per-role means to the logs."""

    def __init__(self, every: int = 50, modules: str | list[str] = "attn", out: str | Path | None = None,
                 backend: str = "auto", overwrite: bool = False, index_column: str | None = "sample_index") -> None:
        # A batch column of dataset indices (remove_unused_columns=False, a collator that passes it):
        # taken out of monitored calls; on other steps the model gets it (transformers' take **kwargs).
        self.monitor = SpectralMonitor(every, modules, out, backend, overwrite, index_column)
        self.pending_logs: dict[str, float] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.monitor.restart()  # a new run: hooks a raised run left are gone, a new file
        refuse_unmonitorable(args)
        self.model = model
        self.accumulation = args.gradient_accumulation_steps
        self.processes = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        # TRL's loss_type other than nll (dft, ...) weighs tokens as the model's loss does not
        self.loss_known = getattr(args, "loss_type", "nll") in ("nll", None)

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if self.monitor.wants(step):
            self.monitor.begin(self.model, step, self.accumulation, self.processes, loss_known=self.loss_known,
                               most=self.accumulation)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.monitor.detach()  # every micro-batch's backward has run: nothing stays on the model

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor.active:
            self.monitor.end()
            self.pending_logs = dict(self.monitor.summary)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Adds the latest summaries to the log record (callbacks after this one see them too)."""
        if logs is not None and self.pending_logs:
            logs.update(self.pending_logs)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending_logs)
            self.pending_logs = {}

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.close()


def refuse_unmonitorable(args) -> None:
    """A ValueError before the first step for what the monitor cannot capture."""
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError("SpectralMonitor hooks one model copy: DataParallel (n_gpu > 1) is not supported; "
                         "run one process per device (torchrun)")
