"""`gradspec project`: a store of each sample's projected gradients, for `gradspec align --store`."""

from __future__ import annotations

import argparse

from gradspec.cli import score
from gradspec.data.errors import check_at_least


def add_parser(sub) -> None:
    p = sub.add_parser("project", help="store each sample's gradient under a random projection (for align --store)")
    p.add_argument("--k", type=int, default=16,
                   help="projection size per side: k x k values per module and sample (default 16)")
    p.add_argument("--spectra", action="store_true", help="also the spectral metrics, in the same pass")
    score.add_run_arguments(p, "store.parquet")


def run(args: argparse.Namespace) -> int:
    check_at_least({"--k": args.k})
    return score.run(args, spectra=args.spectra, project=args.k)
