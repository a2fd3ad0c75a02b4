"""`gradspec diagnose`: the training samples a fine-tuned model did not learn, and why."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gradspec.cli.options import add_options, options_from_args
from gradspec.data.shared_options import Reading
from gradspec.options import option
from gradspec.output_options import out_option, overwrite_option, progress_option


@dataclass(frozen=True, kw_only=True)
class Diagnosed:
    """What diagnose reads and where it writes (gradspec.options); how it reads the data is Reading's,
    what counts as unlearned Thresholds'."""

    base: str | None = option(None, "the model before fine-tuning", kind="path?", required=True)
    model: str | None = option(None, "the fine-tuned model", kind="path?", required=True)
    data: str | None = option(None, "its training data, in training order, as for score", kind="path?", required=True)
    checkpoints: tuple[str, ...] | None = option(None, "earlier checkpoints, oldest first (for forgetting)",
                                                 kind="strs?", many=True)
    dynamics: str | None = option(None, "a dynamics file instead of --checkpoints", kind="path?")
    scores: str | None = option(None, "a gradspec score file of the data: spectra join the evidence", kind="path?")
    out: str = out_option("diagnosis", "output folder")
    overwrite: bool = overwrite_option("replace an earlier diagnosis in --out")
    progress: bool = progress_option()


def add_parser(sub) -> None:
    from gradspec.diagnose.thresholds import Thresholds

    p = sub.add_parser("diagnose", help="find the training samples a fine-tuned model did not learn, and why")
    add_options(p, Diagnosed)
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
