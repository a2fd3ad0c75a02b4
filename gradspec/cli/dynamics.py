"""`gradspec dynamics`: per-sample training dynamics from saved checkpoints."""

from __future__ import annotations

import argparse

from gradspec.data.templates import TEMPLATES


def add_parser(sub) -> None:
    p = sub.add_parser("dynamics", help="per-sample training dynamics from saved checkpoints")
    p.add_argument("--checkpoints", nargs="+", required=True, help="checkpoint folders, in training order")
    p.add_argument("--data", required=True, help="the training data, as for score")
    p.add_argument("--out", default="dynamics.parquet")
    p.add_argument("--template", choices=TEMPLATES, default="plain")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int)
    p.add_argument("--learned-accuracy", type=float,
                   help="token accuracy from which a sample counts as learned (default 0.9)")
    p.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    from gradspec.data.errors import InputError, check_at_least, check_share
    from gradspec.data.models import check_device, check_model
    from gradspec.data.readers import read_samples
    from gradspec.training.dynamics import LEARNED_ACCURACY, from_checkpoints, summarise, write_dynamics

    check_at_least({"--limit": args.limit, "--max-length": args.max_length})
    check_share({"--learned-accuracy": args.learned_accuracy})
    check_device(args.device)
    for checkpoint in args.checkpoints:
        check_model(checkpoint, "--checkpoints")
    samples = list(read_samples(args.data, limit=args.limit))
    if not samples:
        raise InputError(f"{args.data}: no rows")
    measured = from_checkpoints(args.checkpoints, samples, args.template, args.max_length, args.device)
    threshold = LEARNED_ACCURACY if args.learned_accuracy is None else args.learned_accuracy
    write_dynamics(summarise(measured, threshold), args.out, args.checkpoints, threshold)
    print(f"wrote {args.out}: {len(samples)} samples x {len(args.checkpoints)} checkpoints")
    return 0
