"""`gradspec merge`: join the parts of a sharded or --no-merge run into one file."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gradspec.cli.options import add_options, shows_progress
from gradspec.output_options import out_option, progress_option
from gradspec.runs.config import ScoreConfig
from gradspec.runs.run_folder import RunFolder


@dataclass(frozen=True, kw_only=True)
class Merged:
    """merge's options (gradspec.options): the run whose parts it joins."""

    out: str | None = out_option(None, "the --out the run was given", required=True)
    progress: bool = progress_option()


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="join the parts of a sharded or --no-merge run into one file")
    add_options(p, Merged)


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
                        shows_progress(args.progress))
    print(f"wrote {rows} rows to {args.out}")
    return 0
