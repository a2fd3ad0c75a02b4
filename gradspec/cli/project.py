"""`gradspec project`: a store of each sample's projected gradients, for `gradspec align --store`."""

from __future__ import annotations

import argparse

from gradspec.cli import score
from gradspec.data.errors import check_at_least
from gradspec.runs.config import ALIGN_ONLY


def add_parser(sub) -> None:
    p = sub.add_parser("project", help="store each sample's gradient under a random projection (for align --store)")
    score.add_run_arguments(p, "store.parquet", skip=("task", "aggregate", *ALIGN_ONLY),
                            defaults={"spectra": False, "project": 16},
                            helps={"project": "projection size per side: each sample's gradient stored under a k x k "
                                              "Kronecker projection per module, for align --store"})


def run(args: argparse.Namespace) -> int:
    check_at_least({"project": args.project})
    return score.run(args)
