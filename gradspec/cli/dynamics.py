"""`gradspec dynamics`: per-sample training dynamics from saved checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradspec.cli.score import add_field_arguments, fields_of
from gradspec.data.templates import TEMPLATES


def add_parser(sub) -> None:
    p = sub.add_parser("dynamics", help="per-sample training dynamics from saved checkpoints")
    p.add_argument("--checkpoints", nargs="+", required=True, help="checkpoint folders, in training order")
    p.add_argument("--data", required=True, help="the training data, as for score")
    p.add_argument("--out", default="dynamics.parquet", help="a .parquet file (default: dynamics.parquet)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--template", choices=TEMPLATES, default="plain")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int)
    p.add_argument("--learned-accuracy", type=float,
                   help="token accuracy from which a sample counts as learned (default 0.9)")
    p.add_argument("--device", default="cpu")
    add_field_arguments(p)


def run(args: argparse.Namespace) -> int:
    from gradspec.data.errors import InputError, check_at_least, check_parquet_out, check_share, check_writable
    from gradspec.data.models import check_device, check_model
    from gradspec.data.readers import read_samples
    from gradspec.training.dynamics import LEARNED_ACCURACY, from_checkpoints, summarise, write_dynamics

    check_at_least({"--limit": args.limit, "--max-length": args.max_length})
    check_share({"--learned-accuracy": args.learned_accuracy})
    check_device(args.device)
    check_parquet_out(args.out)
    if Path(args.out).exists() and not args.overwrite:
        raise FileExistsError(f"{args.out} exists; pass --overwrite or choose another --out")
    check_writable(args.out)
    for checkpoint in args.checkpoints:
        check_model(checkpoint, "--checkpoints")
    samples = list(read_samples(args.data, fields_of(args), limit=args.limit))
    if not samples:
        raise InputError(f"{args.data}: no rows")
    measured = from_checkpoints(args.checkpoints, samples, args.template, args.max_length, args.device)
    threshold = LEARNED_ACCURACY if args.learned_accuracy is None else args.learned_accuracy
    write_dynamics(summarise(measured, threshold), args.out, args.checkpoints, threshold)
    print(f"wrote {args.out}: {len(samples)} samples x {len(args.checkpoints)} checkpoints")
    return 0
