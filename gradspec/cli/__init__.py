"""gradspec command line: one module per command, each with add_parser(sub) and run(args)."""

from __future__ import annotations

import argparse
import sys

from gradspec.cli import align, diagnose, dynamics, env, merge, project, report, score, select, train
from gradspec.cli.config_file import config_values
from gradspec.data.readers import InputError

COMMANDS = {"score": score, "align": align, "project": project, "select": select, "report": report, "merge": merge,
            "train": train, "dynamics": dynamics, "diagnose": diagnose, "env": env}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradspec", description="Score SFT data by the singular-value spectra of per-sample layer-wise gradients.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):  # the file's options as defaults; the flags given win
            command_parser = sub.choices[args.command]
            command_parser.set_defaults(**config_values(args.config, command_parser, args.command))
            args = parser.parse_args(argv)
        return COMMANDS[args.command].run(args)
    except (InputError, ValueError, OSError, RuntimeError) as e:
        print(f"gradspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
