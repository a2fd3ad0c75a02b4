"""`gradspec select`: keep the best (or worst) rows of a dataset by their scores."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gradspec.cli.options import add_options, shows_progress
from gradspec.options import option
from gradspec.output_options import out_option, overwrite_option, progress_option


@dataclass(frozen=True, kw_only=True)
class Selection:
    """select's options (gradspec.options): the scores, the criterion, how many rows, where they go."""

    scores: str | None = option(None, "a score file from gradspec score", kind="path?", required=True)
    data: str | None = option(None, "the scored input (default: the one the score file names)", kind="path?")
    out: str | None = out_option(None, "where to write the chosen rows: .jsonl, .json, .parquet, or a name without "
                                 "a suffix for a datasets folder", required=True)
    by: str | None = option(None, "a column, a metric averaged over modules (effective_rank), alignment (from "
                            "gradspec align), or weighted z-scores ('effective_rank:1,nuclear_norm:-1')", kind="str?",
                            required=True)
    bottom: bool = option(False, "keep the lowest scores (default: the highest)", kind="bool")
    overwrite: bool = overwrite_option("replace --out if it exists")
    fraction: float | None = option(None, "keep this share of the complete rows (0 < F <= 1)", kind="float?",
                                    one_of="size", required=True)
    count: int | None = option(None, "keep this many rows", kind="int?", one_of="size", required=True)
    length_buckets: int = option(0, "share the rows out evenly over this many length quantiles (choosing within "
                                 "each)", kind="int")
    progress: bool = progress_option()


def add_parser(sub) -> None:
    p = sub.add_parser("select", help="keep the best (or worst) rows of a dataset by their scores")
    add_options(p, Selection)


def run(args: argparse.Namespace) -> int:
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
    progress = shows_progress(args.progress)
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
