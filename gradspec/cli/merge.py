"""`gradspec merge`: join the parts of a sharded or --no-merge run into one file."""

from __future__ import annotations

import argparse

from gradspec.runs.run_folder import RunFolder
from gradspec.runs.scoring import ScoreConfig


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="join the parts of a sharded or --no-merge run into one file")
    p.add_argument("--out", required=True, help="the --out the run was given")


def run(args: argparse.Namespace) -> int:
    folder = RunFolder(args.out)
    manifest = folder.manifest()
    if manifest is None:
        raise ValueError(f"{folder.path}: no run to merge (no manifest.json)")
    data = manifest["data"]
    config = ScoreConfig(data=None if data == "humaneval" else data, limit=manifest["limit"])
    rows = folder.merge(config.records(), manifest["chunk_rows"])
    print(f"wrote {rows} rows to {args.out}")
    return 0
