"""`gradspec ray-score`: gradspec score over a Ray cluster's actors (Ray Data), for many rows
(gradspec.integrations.ray; pip install 'gradspec[ray]')."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from gradspec.cli.options import add_options, options_from_args, shows_progress
from gradspec.cli.score import Shards
from gradspec.options import option
from gradspec.output_options import out_option
from gradspec.runs.config import ALIGN_ONLY, RunSettings, ScoreConfig

_SKIP = ("data", "task", "aggregate", "spectra", "project", "split", "config_name", "streaming", *ALIGN_ONLY)


@dataclass(frozen=True, kw_only=True)
class RayInput:
    """What ray-score reads and where it writes (gradspec.options), each read by every actor."""

    data: str | None = option(None, "JSON, JSONL or Parquet file, or a folder of them: a local path every node "
                              "reads, or a URI pyarrow reads (s3://, gs://, hdfs://, ...)", kind="path?",
                              required=True)
    out: str = out_option("scores.parquet", "output Parquet file, on a filesystem every actor writes (its parts: "
                          "<out>.parts/)")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The Ray cluster ray-score runs on and its actors (gradspec.options)."""

    address: str | None = option(None, "the Ray cluster to join (default: RAY_ADDRESS, else a local cluster of this "
                                 "machine)", kind="str?")
    concurrency: int = option(1, "actors, each holding the model", kind="int")
    num_gpus: float = option(0, "GPUs per actor", kind="float")
    num_cpus: float = option(1, "CPUs per actor (torch's threads in it)", kind="float")


def add_parser(sub) -> None:
    p = sub.add_parser("ray-score", help="gradspec score on a Ray cluster's actors (Ray Data) -> Parquet")
    add_options(p, RayInput)
    add_options(p, ScoreConfig, skip=_SKIP)
    add_options(p, RunSettings, skip=("fsdp", "device_map", "flush_minutes"),
                defaults={"on_error": "skip"}, helps={"device": "cpu or cuda (default: cuda where --num-gpus is "
                                                                "above 0, else cpu)"})
    add_options(p, Cluster)
    add_options(p, Shards, skip=("shard",))


def run(args: argparse.Namespace) -> int:
    import ray

    from gradspec.integrations.ray import score_dataset
    from gradspec.runs.summary import run_summary, written

    options = {**options_from_args(ScoreConfig, args), **options_from_args(RunSettings, args)}
    options.pop("data")  # read by Ray Data, not by gradspec's readers
    if "device" not in getattr(args, "given", {}):
        options.pop("device")  # score_dataset's default: cuda on GPU actors
    quiet = not options.pop("progress")
    finished = options["resume"] and Path(args.out).is_file()  # a resume of a finished run does nothing
    started = not ray.is_initialized()
    if started:  # --quiet: the actors' logs too; the bars show by the one rule
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=not quiet)
    ray.data.DataContext.get_current().enable_progress_bars = shows_progress(not quiet)
    try:
        statuses = score_dataset(args.data, args.out, concurrency=args.concurrency, num_gpus=args.num_gpus,
                                 num_cpus=args.num_cpus, merge=args.merge, **options)
    finally:
        if started:  # this command's connection (and a local cluster it started) ends with it
            ray.shutdown()
    if args.merge:
        print(f"{args.out} was already complete: nothing to resume" if finished else run_summary(args.out))
    else:
        print(f"{written(statuses, args.out + '.parts')}; when all are done: gradspec merge --out {args.out}")
    return 0
