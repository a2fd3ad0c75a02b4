"""`gradspec align`: how well each sample's gradient aligns with a task's, into a Parquet file."""

from __future__ import annotations

import argparse

from gradspec.align.task import AGGREGATES, DEFAULT_AGGREGATES
from gradspec.cli import score
from gradspec.cli.given import refuse_unused


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="exact cosines of each sample's gradient with a task's -> Parquet")
    p.add_argument("--target", help="examples of the task to align with (same formats and fields as --data); "
                                    "required")
    p.add_argument("--aggregate", default=",".join(DEFAULT_AGGREGATES),
                   help=f"comma-separated, of {', '.join(AGGREGATES)}: the cosine with the task's mean gradient, "
                        "the mean and the max of the cosines with each example's (max keeps one gradient per "
                        "example and module)")
    p.add_argument("--spectra", action="store_true", help="also the spectral metrics, in the same pass")
    p.add_argument("--store", help="a store from `gradspec project` instead of --data: only the task goes through "
                                   "the model; the cosines are those of the projected gradients (estimates)")
    score.add_run_arguments(p, "alignment.parquet")


def run(args: argparse.Namespace) -> int:
    if not args.target:
        raise ValueError("align needs --target: a file of examples of the task (on the command line or in --config)")
    if args.store is None:
        return score.run(args, task=args.target, aggregate=args.aggregate, spectra=args.spectra)
    from gradspec.runs.store_query import query_store
    from gradspec.runs.summary import written

    kept = {"target", "aggregate", "store", "out", "overwrite", "device", "batch_tokens", "trust_remote_code",
            "quiet", "config"}
    refuse_unused(args, tuple(dest for dest in getattr(args, "given", {}) if dest not in kept), False,
                  "with --store, which holds the pool, the model and their settings")
    statuses = query_store(args.store, args.target, args.out, args.aggregate, device=args.device,
                           batch_tokens=args.batch_tokens, overwrite=args.overwrite,
                           trust_remote_code=args.trust_remote_code)
    print(written(statuses, args.out))
    return 0
