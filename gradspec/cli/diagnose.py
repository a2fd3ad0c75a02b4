"""`gradspec diagnose`: the training samples a fine-tuned model did not learn, and why."""

from __future__ import annotations

import argparse

from gradspec.cli.options import add_options, options_from_args
from gradspec.data.shared_options import Reading


def add_parser(sub) -> None:
    from gradspec.diagnose.thresholds import Thresholds

    p = sub.add_parser("diagnose", help="find the training samples a fine-tuned model did not learn, and why")
    p.add_argument("--base", required=True, help="the model before fine-tuning")
    p.add_argument("--model", required=True, help="the fine-tuned model")
    p.add_argument("--data", required=True, help="its training data, in training order, as for score")
    p.add_argument("--checkpoints", nargs="+", help="earlier checkpoints, oldest first (for forgetting)")
    p.add_argument("--dynamics", help="a dynamics file instead of --checkpoints")
    p.add_argument("--scores", help="a gradspec score file of the data: spectra join the evidence")
    p.add_argument("--out", default="diagnosis", help="output folder (default: diagnosis)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier diagnosis in --out")
    add_options(p, Reading)
    add_options(p, Thresholds)


def run(args: argparse.Namespace) -> int:
    from gradspec.diagnose.diagnosis import diagnose
    from gradspec.diagnose.thresholds import Thresholds

    reading = Reading(**options_from_args(Reading, args))
    thresholds = Thresholds(**options_from_args(Thresholds, args))
    report = diagnose(args.base, args.model, args.data, args.out, args.checkpoints, args.dynamics, args.scores,
                      reading.template, reading.max_length, reading.limit, reading.device, thresholds,
                      args.overwrite, reading.fields)
    print(f"wrote {report}")
    return 0
