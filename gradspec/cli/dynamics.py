"""`gradspec dynamics`: per-sample training dynamics from saved checkpoints."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gradspec.cli.options import add_options, options_from_args
from gradspec.data.shared_options import Reading
from gradspec.options import option
from gradspec.output_options import out_option, overwrite_option, progress_option


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What dynamics reads and where it writes (gradspec.options); how it reads the data is Reading's."""

    checkpoints: tuple[str, ...] | None = option(None, "checkpoint folders, in training order", kind="strs?",
                                                 required=True, many=True)
    data: str | None = option(None, "the training data, as for score", kind="path?", required=True)
    out: str = out_option("dynamics.parquet", "a .parquet file")
    overwrite: bool = overwrite_option("replace --out if it exists")
    progress: bool = progress_option()
    learned_accuracy: float | None = option(None, "token accuracy from which a sample counts as learned (default "
                                            "0.9)", kind="float?")


def add_parser(sub) -> None:
    p = sub.add_parser("dynamics", help="per-sample training dynamics from saved checkpoints")
    add_options(p, Measured)
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
