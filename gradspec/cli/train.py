"""`gradspec train`: a small SFT run with the loss of your choice, the spectral monitor and dynamics."""

from __future__ import annotations

import argparse

from gradspec.cli.given import refuse_unused
from gradspec.cli.options import add_options, options_from_args
from gradspec.training.train import TrainConfig


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="small SFT run with --loss ntp|wit|sftmix, the spectral monitor and dynamics")
    add_options(p, TrainConfig)


def run(args: argparse.Namespace) -> int:
    from gradspec.training.train import run_files, train

    refuse_unused(args, ("prompt_weight", "response_weight"), args.loss == "wit", "without --loss wit")
    written = run_files(train(TrainConfig(**options_from_args(TrainConfig, args))))
    monitored = any(p.name.startswith("monitor") for p in written)  # monitor.parquet, or one per rank
    print(f"wrote {', '.join(map(str, written))}" + ("" if monitored else
                                                     " (no monitor.parquet: fewer steps than --monitor-every)"))
    return 0
