"""`gradspec ray-score`: gradspec score over a Ray cluster's actors (Ray Data), for many rows
(gradspec.integrations.ray; pip install 'gradspec[ray]')."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gradspec.cli.options import add_options, options_from_args
from gradspec.runs.config import ALIGN_ONLY, RunSettings, ScoreConfig

_SKIP = ("data", "task", "aggregate", "spectra", "project", "split", "config_name", "streaming", *ALIGN_ONLY)


def add_parser(sub) -> None:
    p = sub.add_parser("ray-score", help="gradspec score on a Ray cluster's actors (Ray Data) -> Parquet")
    p.add_argument("--data", required=True,
                   help="JSON, JSONL or Parquet file, or a folder of them: a local path every node reads, or a URI "
                        "pyarrow reads (s3://, gs://, hdfs://, ...)")
    p.add_argument("--out", default="scores.parquet",
                   help="output Parquet file, on a filesystem every actor writes (its parts: <out>.parts/)")
    add_options(p, ScoreConfig, skip=_SKIP)
    add_options(p, RunSettings, skip=("fsdp", "device_map", "flush_minutes"),
                defaults={"on_error": "skip"}, helps={"device": "cpu or cuda (default: cuda where --num-gpus is "
                                                                "above 0, else cpu)"})
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or None,
                   help="the Ray cluster to join (default: RAY_ADDRESS, else a local cluster of this machine)")
    p.add_argument("--concurrency", type=int, default=1, help="actors, each holding the model")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor")
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs per actor (torch's threads in it)")
    p.add_argument("--no-merge", dest="merge", action="store_false",
                   help="leave the parts in <out>.parts/ (merge later with `gradspec merge`)")


def run(args: argparse.Namespace) -> int:
    import ray

    from gradspec.integrations.ray import score_dataset
    from gradspec.runs.summary import run_summary, written

    options = {**options_from_args(ScoreConfig, args), **options_from_args(RunSettings, args)}
    options.pop("data")  # read by Ray Data, not by gradspec's readers
    if "device" not in getattr(args, "given", {}):
        options.pop("device")  # score_dataset's default: cuda on GPU actors
    progress = options.pop("progress")
    finished = options["resume"] and Path(args.out).is_file()  # a resume of a finished run does nothing
    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address, log_to_driver=progress)
    ray.data.DataContext.get_current().enable_progress_bars = progress
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
