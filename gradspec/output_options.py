"""The options of what a command writes and shows, declared once (gradspec.options) for every command:
where it writes (--out), whether it may replace what is there (--overwrite), whether it shows progress
bars (--quiet). Each command gives its own default and help where they differ; the rest is one
declaration, so that the three read, check and behave alike everywhere."""

from __future__ import annotations

from typing import Any

from gradspec.options import option


def out_option(default: str | None, help: str, required: bool = False) -> Any:
    """--out: where the command writes (a file or a folder, as help says); the command line's alone,
    never a --config file's (config_file: a file is data, never authority)."""
    return option(default, help, kind="path" if default is not None else "path?", required=required,
                  from_file=False)


def overwrite_option(help: str) -> Any:
    """--overwrite: replace what an earlier run left at --out (help: what that is); the command line's
    alone, since it decides what is deleted."""
    return option(False, help, kind="bool", from_file=False)


def progress_option() -> Any:
    """progress (on by default; --quiet turns it off): whether the command's progress bars may show.
    Where they do is one rule for every command: gradspec.cli.options.shows_progress."""
    return option(True, "show a progress bar", kind="bool", flag="--quiet",
                  flag_help="no progress bar (one shows on a terminal)")
