"""`gradspec report`: compare labelled score files, or draw a monitored run, in figures and a Markdown summary."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gradspec.cli.options import add_options, shows_progress
from gradspec.options import option
from gradspec.output_options import out_option, overwrite_option, progress_option


@dataclass(frozen=True, kw_only=True)
class Reported:
    """report's options (gradspec.options): the files compared, where the report goes."""

    groups: tuple[str, ...] | None = option(None, "e.g. high=high.parquet low=low.parquet; or one monitor file or "
                                            "folder (monitor.parquet)", kind="strs?", positional=True, many=True,
                                            metavar="LABEL=SCORES")
    out: str = out_option("report", "output folder")
    overwrite: bool = overwrite_option("write into an --out folder that is not empty")
    progress: bool = progress_option()


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="compare labelled score files, or draw a training run's spectra over time "
                                      "(a spectral monitor's output): figures and a Markdown summary")
    add_options(p, Reported)


def run(args: argparse.Namespace) -> int:
    from gradspec.analysis.monitor_report import is_monitor_output, write_monitor_report
    from gradspec.analysis.report import write_report

    if len(args.groups) == 1 and "=" not in args.groups[0] and is_monitor_output(args.groups[0]):
        print(f"wrote {write_monitor_report(args.groups[0], args.out, args.overwrite)}")
        return 0
    groups = {}
    for spec in args.groups:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"{spec!r}: expected LABEL=SCORES, e.g. high=high.parquet, or a single spectral "
                             "monitor's output (a file or folder with a step column)")
        if label in groups:
            raise ValueError(f"label {label!r} is given twice; give each score file its own label")
        groups[label] = path
    print(f"wrote {write_report(groups, args.out, args.overwrite, shows_progress(args.progress))}")
    return 0
