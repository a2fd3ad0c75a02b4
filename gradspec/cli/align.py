"""`gradspec align`: how well each sample's gradient aligns with a task's, into a Parquet file."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gradspec.cli import score
from gradspec.cli.given import refuse_unused
from gradspec.cli.options import add_options
from gradspec.options import option


@dataclass(frozen=True, kw_only=True)
class StoreQuery:
    """align's own options (gradspec.options): a projected store to query instead of a pass over the pool."""

    store: str | None = option(None, "a store from `gradspec project` instead of --data: only the task goes "
                               "through the model; the cosines are those of the projected gradients (estimates)",
                               kind="path?")
    top: int | None = option(None, "with --store: only the K rows of highest align_mean (else align_mean_gradient, "
                             "else align_max), found through the store's FAISS index (gradspec project --index) "
                             "and their values computed exactly; seconds for a million rows", kind="int?",
                             metavar="K")


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="exact cosines of each sample's gradient with a task's -> Parquet")
    add_options(p, StoreQuery)
    score.add_run_arguments(p, "alignment.parquet", skip=("project",), defaults={"spectra": False},
                            helps={"task": "examples of the task to align with (same formats and fields as --data); "
                                           "required"})


def run(args: argparse.Namespace) -> int:
    if not args.task:
        raise ValueError("align needs --target: a file of examples of the task (on the command line or in --config)")
    if args.store is None:
        if args.top is not None:
            raise ValueError("--top needs --store: it reads a store's index (gradspec project --index)")
        return score.run(args)
    from gradspec.runs.store_query import query_store
    from gradspec.runs.summary import written

    kept = {"task", "aggregate", "store", "out", "overwrite", "device", "batch_tokens", "trust_remote_code",
            "progress", "config", "top"}
    refuse_unused(args, tuple(dest for dest in getattr(args, "given", {}) if dest not in kept), False,
                  "with --store, which holds the pool, the model and their settings")
    statuses = query_store(args.store, args.task, args.out, args.aggregate, device=args.device,
                           batch_tokens=args.batch_tokens, overwrite=args.overwrite,
                           trust_remote_code=args.trust_remote_code, top=args.top)
    print(written(statuses, args.out))
    if args.top is not None:
        from gradspec.runs.score_files import read_metadata

        found = read_metadata(args.out)["top"]
        print(f"top {args.top} by {found['by']} from {found['index']} ({found['candidates']} candidates): "
              f"{found['described']}")
    return 0
