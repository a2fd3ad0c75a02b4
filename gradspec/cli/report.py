"""`gradspec report`: compare labelled score files, or draw a monitored run, in figures and a Markdown summary."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="compare labelled score files, or draw a training run's spectra over time "
                                      "(a spectral monitor's output): figures and a Markdown summary")
    p.add_argument("groups", nargs="+", metavar="LABEL=SCORES",
                   help="e.g. high=high.parquet low=low.parquet; or one monitor file or folder (monitor.parquet)")
    p.add_argument("--out", default="report", help="output folder (default: report)")
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that is not empty")
    p.add_argument("--quiet", action="store_true", help="no progress bar (one shows on a terminal)")


def run(args: argparse.Namespace) -> int:
    import sys

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
    print(f"wrote {write_report(groups, args.out, args.overwrite, not args.quiet and sys.stderr.isatty())}")
    return 0
