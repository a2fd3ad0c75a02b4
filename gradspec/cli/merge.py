"""`gradspec merge`: join the parts of a sharded or --no-merge run into one file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradspec.runs.config import ScoreConfig
from gradspec.runs.run_folder import RunFolder


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="join the parts of a sharded or --no-merge run into one file")
    p.add_argument("--out", required=True, help="the --out the run was given")
    p.add_argument("--quiet", action="store_true", help="no progress bar (one shows on a terminal)")


def run(args: argparse.Namespace) -> int:
    if args.out.endswith(".parts"):
        raise ValueError(f"--out {args.out}: pass the --out the run was given ({args.out.removesuffix('.parts')}), "
                         "not its .parts folder")
    if Path(args.out).suffix != ".parquet":
        raise ValueError(f"--out {args.out}: pass the .parquet --out the run was given")
    folder = RunFolder(args.out)
    if folder.tidy_merged():
        print(f"{args.out}: already merged (removed the parts a stopped merge left)")
        return 0
    manifest = folder.manifest()
    if manifest is None:
        if Path(args.out).is_file():
            raise ValueError(f"{args.out} is already a merged file: nothing to merge")
        raise ValueError(f"{folder.path}: no run to merge (no manifest.json)")
    rows = folder.merge(ScoreConfig.from_manifest(manifest).records(), manifest["chunk_rows"],
                        not args.quiet and sys.stderr.isatty())
    print(f"wrote {rows} rows to {args.out}")
    return 0
