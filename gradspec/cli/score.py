"""`gradspec score`: per-sample gradient spectra of a dataset, into a Parquet file."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradspec.cli.given import refuse_unused
from gradspec.cli.options import add_options, options_from_args, shows_progress
from gradspec.options import option
from gradspec.output_options import out_option
from gradspec.runs.config import ALIGN_ONLY, RunSettings, ScoreConfig

if TYPE_CHECKING:
    from gradspec.runs.run_folder import Shard


def _shard(text: str) -> Shard:
    from gradspec.runs.run_folder import Shard  # here: the run folder's modules load only for a run

    return Shard.parse(text)


@dataclass(frozen=True, kw_only=True)
class RunFiles:
    """The command line's options of a scoring run that are not its config's (gradspec.options): what it
    reads its options from and where it writes."""

    config: str | None = option(None, "options from a YAML or JSON file (keys: the flags' names), or a run's "
                                "manifest.json or score file to replay that run; flags given here override it",
                                kind="path?", metavar="FILE")
    out: str = out_option("scores.parquet", "output Parquet file")


@dataclass(frozen=True, kw_only=True)
class Shards:
    """How a run is split across processes: which shard this one takes, and whether its parts are merged
    at the end (score, align, project, ray-score and validate; validate words them its own way)."""

    shard: Shard | None = option(None, "score only shard I of N (e.g. a Slurm array task); join with `gradspec "
                                 "merge` (torchrun needs no flag: each rank takes its own shard)", kind="str?",
                                 metavar="I/N", parse=_shard)
    merge: bool = option(True, "merge the parts into the output file", kind="bool", flag="--no-merge",
                         flag_help="leave the parts in <out>.parts/ (merge later with `gradspec merge`)")


def add_parser(sub) -> None:
    add_run_arguments(sub.add_parser("score", help="per-sample gradient spectra of a dataset -> Parquet"),
                      "scores.parquet", skip=("task", "aggregate", "spectra", "project", *ALIGN_ONLY))


def add_run_arguments(p: argparse.ArgumentParser, out: str, skip: tuple[str, ...] = (),
                      defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None) -> None:
    """The options of a scoring run, shared by score, align and project: ScoreConfig's (but skip) and
    RunSettings' flags, with this command's defaults and helps, and the run folder's own."""
    add_options(p, RunFiles, defaults={"out": out})
    add_options(p, ScoreConfig, skip=skip, defaults=defaults, helps=helps)
    add_options(p, RunSettings)
    add_options(p, Shards)


def refuse_unused_options(args: argparse.Namespace, spectra: bool, project: int) -> None:
    """The options a run of these settings would ignore, named."""
    refuse_unused(args, ("save_spectra", "method", "backend"), spectra,
                  "without the spectral metrics (add --spectra)")
    lowrank = spectra and args.method == "lowrank"
    refuse_unused(args, ("rank",), lowrank, "without --method lowrank")
    refuse_unused(args, ("seed",), lowrank or project > 0, "without --method lowrank")


def run(args: argparse.Namespace) -> int:
    config = ScoreConfig(**options_from_args(ScoreConfig, args))  # every option checked before torch loads
    refuse_unused_options(args, config.spectra, config.project)
    settings = RunSettings(**options_from_args(RunSettings, args))
    settings = replace(settings, progress=shows_progress(settings.progress))
    from gradspec.invocation import program
    from gradspec.runs.distributed import torchrun_shard
    from gradspec.runs.preconditioning import factors_to_write
    from gradspec.runs.run_folder import INPUT_ERROR, RunFolder
    from gradspec.runs.scoring import run as run_scoring
    from gradspec.runs.summary import run_summary, written

    finished = settings.resume and Path(args.out).is_file()  # a resume of a finished run does nothing (else refused)
    factors = factors_to_write(config)
    statuses = run_scoring(config, args.out, **asdict(settings), shard=args.shard, merge=args.merge)
    if factors is not None and Path(factors).is_file():
        print(f"wrote the {config.precondition} factors it fitted to {factors}: a later run given --factors "
              f"{factors} reads them")
    folder = RunFolder(args.out)
    if finished:  # and its rows were counted when it was written: no "wrote" line now
        print(f"{args.out} was already complete: nothing to resume")
        return 0
    rank = torchrun_shard()
    if rank is not None and rank.index > 0:  # rank 0 merges, maybe before this line: what this rank wrote
        print(f"{written(statuses, folder.path)}" + (f"; rank 0 merges them into {args.out}" if args.merge else ""))
    # merged: the file is there and no part is left (a folder kept for files the run did not write aside)
    elif Path(args.out).exists() and not any(folder.path.glob("*.parquet")):
        print(run_summary(args.out))
    else:
        print(f"{written(statuses, folder.path)}; when all are done: "
              f"{program()} merge --out {args.out}")
    if statuses.get(INPUT_ERROR) and folder.errors_path.exists():
        print(f"skipped rows and why: {folder.errors_path}")
    return 0
