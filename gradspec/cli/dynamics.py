"""`gradspec dynamics`: per-sample training dynamics from saved checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradspec.cli.options import add_options, options_from_args
from gradspec.data.shared_options import Reading


def add_parser(sub) -> None:
    p = sub.add_parser("dynamics", help="per-sample training dynamics from saved checkpoints")
    p.add_argument("--checkpoints", nargs="+", required=True, help="checkpoint folders, in training order")
    p.add_argument("--data", required=True, help="the training data, as for score")
    p.add_argument("--out", default="dynamics.parquet", help="a .parquet file (default: dynamics.parquet)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--learned-accuracy", type=float,
                   help="token accuracy from which a sample counts as learned (default 0.9)")
    add_options(p, Reading)


def run(args: argparse.Namespace) -> int:
    from gradspec.data.errors import InputError, check_parquet_out, check_share, check_writable
    from gradspec.data.models import check_device, check_model
    from gradspec.data.readers import read_samples
    from gradspec.training.dynamics import LEARNED_ACCURACY, from_checkpoints, summarise, write_dynamics

    reading = Reading(**options_from_args(Reading, args))
    check_share({"learned_accuracy": args.learned_accuracy})
    check_device(reading.device)
    check_parquet_out(args.out)
    if Path(args.out).exists() and not args.overwrite:
        raise FileExistsError(f"{args.out} exists; pass --overwrite or choose another --out")
    check_writable(args.out)
    for checkpoint in args.checkpoints:
        check_model(checkpoint, "checkpoints")
    samples = list(read_samples(args.data, reading.fields, limit=reading.limit))
    if not samples:
        raise InputError(f"{args.data}: no rows")
    measured = from_checkpoints(args.checkpoints, samples, reading.template, reading.max_length, reading.device)
    threshold = LEARNED_ACCURACY if args.learned_accuracy is None else args.learned_accuracy
    write_dynamics(summarise(measured, threshold), args.out, args.checkpoints, threshold)
    print(f"wrote {args.out}: {len(samples)} samples x {len(args.checkpoints)} checkpoints")
    return 0
