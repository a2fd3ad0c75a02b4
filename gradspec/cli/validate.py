"""`gradspec validate`: does a score predict what training does? Retrains on random subsets (LDS) and on
each score's selection (the outcome), then the analysis of the scores against those retrains."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from gradspec.cli.given import refuse_unused
from gradspec.cli.options import add_options, options_from_args, shows_progress
from gradspec.cli.score import Shards
from gradspec.validation.config import ValidateConfig, ValidateSettings

# What only a retrain uses: refused with --runs, which analyses retrains made before
_RETRAIN_ONLY = ("data", "target", "model", "template", "max_length", "limit", "subsets", "fraction", "outcome",
                 "top", "seeds", "length_buckets", "epochs", "max_steps", "batch_size", "learning_rate", "lora_rank",
                 "removal", "remove", "seed", "metric", "metric_limit", "device", "resume", "shard", "merge", "out",
                 "objectives", "prompt_weight", "response_weight")


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="does a score predict training? retrains on random subsets (LDS) and on "
                                        "each score's selection, against the loss on a target")
    add_options(p, ValidateConfig, skip=("outcome", "removal", "objectives"))
    # none given: None (the Python default, (), is no default to show in --help)
    add_options(p, ValidateConfig, only=("outcome", "removal", "objectives"),
                defaults={"outcome": None, "removal": None, "objectives": None}, helps={
        "outcome": "selection outcome: score specs whose top --top of the pool is retrained on, beside random and "
                   "length",
        "removal": "removal test: score specs whose top and whose bottom --remove of the pool are each left out of "
                   "a retrain, beside random rows"})
    add_options(p, ValidateSettings, skip=("scores", "runs"))
    add_options(p, ValidateSettings, only=("scores", "runs"), defaults={"scores": None, "runs": None}, helps={
        "scores": "scores to test: an attribution file (align --attribution), or a score or align file with a "
                  "per-sample column or select --by expression after ':'",
        "runs": "analyse these retrain files (validate's --out) instead of retraining"})
    add_options(p, Shards, helps={
        "shard": "run only shard I of N of the retrains; once all are done, the same command with --resume and no "
                 "--shard merges them (torchrun needs no flag: each rank takes its own shard)",
        "merge": "leave the retrains' parts in <out>.parts/ (merged later by the same command with --resume)"})


def run(args: argparse.Namespace) -> int:
    from gradspec.validation.report import analyse, summary, write_report

    settings = ValidateSettings(**options_from_args(ValidateSettings, args))
    settings = replace(settings, progress=shows_progress(settings.progress))
    if settings.runs:
        refuse_unused(args, _RETRAIN_ONLY, False, "with --runs, which analyses retrains made before")
        files = list(settings.runs)
    else:
        refuse_unused(args, ("prompt_weight", "response_weight"), "wit" in (args.objectives or ()),
                      "without --objectives wit")
        from gradspec.validation.run import retrain  # here: torch loads only for a retrain

        config = ValidateConfig(**options_from_args(ValidateConfig, args))
        began = time.perf_counter()
        ran = retrain(config, settings, shard=args.shard, merge=args.merge)
        merged = Path(settings.out).is_file() and not any(Path(f"{settings.out}.parts").glob("*.parquet"))
        if not merged:
            print(f"ran {ran} retrains into {settings.out}.parts in {time.perf_counter() - began:.0f} s; when all are "
                  f"done, the same command with --resume (and no --shard) merges them")
            return 0
        print(f"wrote {settings.out}" + (f" ({ran} retrains in {time.perf_counter() - began:.0f} s)" if ran else
                                         " (already complete: nothing to resume)"))
        files = [settings.out]
    analysis = analyse(files, list(settings.scores), settings.resamples, settings.confidence)
    print(summary(analysis, settings.confidence))
    if settings.report is not None:
        print(f"wrote {write_report(analysis, settings.report, settings.overwrite, settings.confidence)}")
    return 0
