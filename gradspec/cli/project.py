"""`gradspec project`: a store of each sample's projected gradients, for `gradspec align --store`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gradspec.cli import score
from gradspec.cli.options import add_options
from gradspec.data.errors import check_at_least
from gradspec.options import option
from gradspec.runs.config import ALIGN_ONLY


@dataclass(frozen=True, kw_only=True)
class Index:
    """project's own option (gradspec.options): a FAISS index of the store, for align --store --top."""

    index: bool = option(False, "then write a FAISS index beside the store (<out>.faiss, <out>.vectors: needs "
                         "faiss-cpu) for align --store --top; with --resume, of a store already written", kind="bool")


def add_parser(sub) -> None:
    p = sub.add_parser("project", help="store each sample's gradient under a random projection (for align --store)")
    score.add_run_arguments(p, "store.parquet", skip=("task", "aggregate", *ALIGN_ONLY),
                            defaults={"spectra": False, "project": 16},
                            helps={"project": "projection size per side: each sample's gradient stored under a k x k "
                                              "Kronecker projection per module, for align --store"})
    add_options(p, Index)


def run(args: argparse.Namespace) -> int:
    check_at_least({"project": args.project})
    if args.index:
        from gradspec.runs.store_index import require_faiss

        require_faiss()  # refused before the run, not after it
    code = score.run(args)
    if args.index:
        from gradspec.runs.run_folder import RunFolder
        from gradspec.runs.store_index import build_index, index_path

        if not Path(args.out).is_file() or any(RunFolder(args.out).path.glob("*.parquet")):
            print(f"no index yet: the store is not merged; after `gradspec merge --out {args.out}`, run this "
                  f"command again with --resume --index")
            return code
        header = build_index(args.out)
        r = header["recall"]
        print(f"wrote {index_path(args.out)} ({header['settings']['kind']}, {header['indexed']} rows, "
              f"{header['build_s']:.1f} s): recall@{r['at']} {r['value']:.3f} on {r['probes']} probe queries")
    return code
