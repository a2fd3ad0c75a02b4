"""`gradspec diagnose`: the training samples a fine-tuned model did not learn, and why."""

from __future__ import annotations

import argparse

from gradspec.cli.options import add_options, options_from_args
from gradspec.cli.score import add_field_arguments, fields_of
from gradspec.data.templates import TEMPLATES


def add_parser(sub) -> None:
    from gradspec.diagnose.diagnosis import Thresholds

    p = sub.add_parser("diagnose", help="find the training samples a fine-tuned model did not learn, and why")
    p.add_argument("--base", required=True, help="the model before fine-tuning")
    p.add_argument("--model", required=True, help="the fine-tuned model")
    p.add_argument("--data", required=True, help="its training data, in training order, as for score")
    p.add_argument("--checkpoints", nargs="+", help="earlier checkpoints, oldest first (for forgetting)")
    p.add_argument("--dynamics", help="a dynamics file instead of --checkpoints")
    p.add_argument("--scores", help="a gradspec score file of the data: spectra join the evidence")
    p.add_argument("--out", default="diagnosis", help="output folder (default: diagnosis)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier diagnosis in --out")
    p.add_argument("--template", choices=TEMPLATES, default="plain")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int)
    p.add_argument("--device", default="cpu")
    add_field_arguments(p)
    add_options(p, Thresholds)


def run(args: argparse.Namespace) -> int:
    from gradspec.diagnose.diagnosis import Thresholds, diagnose

    thresholds = Thresholds(**options_from_args(Thresholds, args))
    report = diagnose(args.base, args.model, args.data, args.out, args.checkpoints, args.dynamics, args.scores,
                      args.template, args.max_length, args.limit, args.device, thresholds,
                      args.overwrite, fields_of(args))
    print(f"wrote {report}")
    return 0
