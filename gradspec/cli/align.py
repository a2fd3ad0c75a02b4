"""`gradspec align`: how well each sample's gradient aligns with a task's, into a Parquet file."""

from __future__ import annotations

import argparse

from gradspec.align.task import AGGREGATES, DEFAULT_AGGREGATES
from gradspec.cli import score


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="exact cosines of each sample's gradient with a task's -> Parquet")
    p.add_argument("--target", required=True,
                   help="examples of the task to align with (same formats and fields as --data)")
    p.add_argument("--aggregate", default=",".join(DEFAULT_AGGREGATES),
                   help=f"comma-separated, of {', '.join(AGGREGATES)}: the cosine with the task's mean gradient, "
                        "the mean and the max of the cosines with each example's (max keeps one gradient per "
                        "example and module)")
    p.add_argument("--spectra", action="store_true", help="also the spectral metrics, in the same pass")
    score.add_run_arguments(p, "alignment.parquet")


def run(args: argparse.Namespace) -> int:
    return score.run(args, task=args.target, aggregate=args.aggregate, spectra=args.spectra)
