"""`gradspec train`: a small SFT run with the loss of your choice, the spectral monitor and dynamics."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from gradspec.cli.given import refuse_unused
from gradspec.cli.options import add_options, options_from_args, shows_progress
from gradspec.training.train import TrainConfig


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="small SFT run with --loss ntp|wit|sftmix, the spectral monitor and dynamics")
    add_options(p, TrainConfig)


def run(args: argparse.Namespace) -> int:
    from gradspec.training.train import run_files, train

    refuse_unused(args, ("prompt_weight", "response_weight"), args.loss == "wit", "without --loss wit")
    options = options_from_args(TrainConfig, args)
    config = TrainConfig(**options | {"progress": shows_progress(options.get("progress", True))})
    out = train(config)
    end_process_group()
    written = run_files(out)
    monitors = [p for p in written if p.name.startswith("monitor")]  # monitor.parquet, or one per rank
    print(f"wrote {', '.join(map(str, written))}" + ("" if monitors else
                                                     " (no monitor.parquet: fewer steps than --monitor-every)"))
    steps = next_steps(config, monitors)
    if steps:
        print(steps)
    return 0


def end_process_group() -> None:
    """Under torchrun, the process group Trainer started (accelerate's) ended once every rank is done: a
    process that exits with it alive may abort in gloo's threads ("terminate called without an active
    exception"), as one rank did under load. The command owns its process; train() leaves the group be."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def next_steps(config: TrainConfig, monitors: list[Path]) -> str:
    """The commands that read what a training run wrote: its monitor's report, the diagnosis of the samples it
    did not learn (given the training file: HumanEval, the default, is no file to diagnose)."""
    from gradspec.choices import DEFAULT_MODEL, MAX_LENGTH
    from gradspec.invocation import program

    command, out = program(), Path(config.out)
    lines = ["next:"]
    for monitor in monitors:
        report = out / ("report" + monitor.stem.removeprefix("monitor"))  # under torchrun one per rank's file
        lines.append(f"  {command} report {monitor} --out {report}   # its spectra over training")
    if config.data is not None:
        reading = "".join(f" {flag} {value}" for flag, value, default in (
            ("--template", config.template, "plain"), ("--max-length", config.max_length, MAX_LENGTH),
            ("--limit", config.limit, None), *_fields(config.fields)) if value != default)
        lines.append(f"  {command} diagnose --base {config.model or DEFAULT_MODEL} --model {out / 'model'} --data "
                     f"{config.data}{reading} --dynamics {out / 'dynamics.parquet'} --out {out / 'diagnosis'}   "
                     "# the samples it did not learn, and why")
    return "\n".join(lines) if len(lines) > 1 else ""


def _fields(fields) -> list[tuple[str, str, str]]:
    """(flag, value, default) of each column name the training data was read with."""
    return [(f"--{f.name}-field", getattr(fields, f.name), f.default) for f in dataclasses.fields(fields)]
