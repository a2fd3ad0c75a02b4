"""`gradspec select`: keep the best (or worst) rows of a dataset by their scores."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("select", help="keep the best (or worst) rows of a dataset by their scores")
    p.add_argument("--scores", required=True, help="a score file from gradspec score")
    p.add_argument("--data", help="the scored input (default: the one the score file names)")
    p.add_argument("--out", required=True, help="where to write the chosen rows: .jsonl, .json, .parquet, or a "
                   "name without a suffix for a datasets folder")
    p.add_argument("--by", required=True,
                   help="a column, a metric averaged over modules (effective_rank), alignment (from gradspec "
                        "align), or weighted z-scores "
                        "('effective_rank:1,nuclear_norm:-1')")
    p.add_argument("--bottom", action="store_true", help="keep the lowest scores (default: the highest)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--fraction", type=float, help="keep this share of the complete rows (0 < F <= 1)")
    size.add_argument("--count", type=int, help="keep this many rows")
    p.add_argument("--length-buckets", type=int, default=0, help="share the rows out evenly over this many length "
                   "quantiles (choosing within each)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (one shows on a terminal)")


def run(args: argparse.Namespace) -> int:
    import sys

    from gradspec.analysis.select import (
        check_criteria,
        check_output,
        check_size,
        choose,
        competing,
        criteria,
        read_criteria,
        write_selection,
    )
    from gradspec.data.errors import InputError, check_writable
    from gradspec.data.hub import is_dataset_name
    from gradspec.data.in_memory import is_label
    from gradspec.data.readers import Hub, check_readable
    from gradspec.runs.score_files import check_scored_input, parquet_schema, read_metadata

    meta = read_metadata(args.scores)
    data = args.data or meta.get("data")
    if not data or data == "humaneval":
        raise ValueError(f"{args.scores} does not name a data file to select from; pass --data")
    if not args.data and is_label(data):
        raise InputError(f"{args.scores} scored rows given in memory ({data}); pass --data with a file of those rows")
    if not args.data and not Path(data).exists() and not is_dataset_name(data):
        raise InputError(f"{data}, the input {args.scores} scored, is gone; pass --data with where it is now")
    check_scored_input(meta, data, args.scores)
    if Path(args.out).exists() and Path(args.out).resolve() == Path(data).resolve():
        raise ValueError(f"--out {args.out} is the scored input itself; choose another path")
    if Path(args.out).exists() and not args.overwrite:
        raise FileExistsError(f"{args.out} exists; pass --overwrite or choose another --out")
    check_writable(args.out)
    # everything else that can be refused is, before a row is read (a million rows take a minute)
    check_size(args.fraction, args.count, args.length_buckets)
    check_criteria(parquet_schema(args.scores, "pass a score file"), args.by)
    check_output(args.out)
    check_readable(data)
    progress = not args.quiet and sys.stderr.isatty()
    scores = read_criteria(args.scores, args.by, progress)
    chosen = choose(scores, args.by, top=not args.bottom, fraction=args.fraction, count=args.count,
                    length_buckets=args.length_buckets)
    columns = ["gradspec_score", *dict.fromkeys(name for name, _ in criteria(args.by)), "loss", "num_tokens"]
    n = write_selection(data, chosen, args.out, columns, Hub(**meta.get("hub", {})))
    competes = competing(scores, args.by)
    left_out = [f"{count} {status}" for status, count in scores.loc[~competes, "status"].value_counts().items()]
    valueless = int(competes.sum()) - chosen.attrs["valued"]
    if valueless:  # complete rows with no value of the criterion: NaN there (an expert the row did not reach)
        left_out.append(f"{valueless} without a value of {args.by}")
    why = ", ".join(left_out) or "none"
    short = f"; --count {args.count} asked for more" if args.count is not None and n < args.count else ""
    print(f"wrote {n} of {len(scores)} rows to {args.out} (only complete rows compete; left out: {why}{short})")
    return 0
