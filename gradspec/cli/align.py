"""`gradspec align`: how well each sample's gradient aligns with a task's, into a Parquet file."""

from __future__ import annotations

import argparse

from gradspec.cli import score
from gradspec.cli.given import refuse_unused


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="exact cosines of each sample's gradient with a task's -> Parquet")
    p.add_argument("--store", help="a store from `gradspec project` instead of --data: only the task goes through "
                                   "the model; the cosines are those of the projected gradients (estimates)")
    score.add_run_arguments(p, "alignment.parquet", skip=("project",), defaults={"spectra": False},
                            helps={"task": "examples of the task to align with (same formats and fields as --data); "
                                           "required"})


def run(args: argparse.Namespace) -> int:
    if not args.task:
        raise ValueError("align needs --target: a file of examples of the task (on the command line or in --config)")
    if args.store is None:
        return score.run(args)
    from gradspec.runs.store_query import query_store
    from gradspec.runs.summary import written

    kept = {"task", "aggregate", "store", "out", "overwrite", "device", "batch_tokens", "trust_remote_code",
            "progress", "config"}
    refuse_unused(args, tuple(dest for dest in getattr(args, "given", {}) if dest not in kept), False,
                  "with --store, which holds the pool, the model and their settings")
    statuses = query_store(args.store, args.task, args.out, args.aggregate, device=args.device,
                           batch_tokens=args.batch_tokens, overwrite=args.overwrite,
                           trust_remote_code=args.trust_remote_code)
    print(written(statuses, args.out))
    return 0
