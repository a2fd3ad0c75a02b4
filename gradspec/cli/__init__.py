"""gradspec command line: one module per command, each with add_parser(sub) and run(args)."""

from __future__ import annotations

import argparse
import sys

from gradspec.cli import align, diagnose, dynamics, env, merge, project, report, score, select, train
from gradspec.cli.config_file import config_values
from gradspec.cli.given import given_options
from gradspec.data.readers import InputError

COMMANDS = {"score": score, "align": align, "project": project, "select": select, "report": report, "merge": merge,
            "train": train, "dynamics": dynamics, "diagnose": diagnose, "env": env}


def _joined(argv: list[str]) -> list[str]:
    """argv with '--shard V' as '--shard=V': argparse takes a V that starts with '-' for an option."""
    out: list[str] = []
    for token in argv:
        if out and out[-1] == "--shard" and token.startswith("-"):
            out[-1] = f"--shard={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradspec", description="Score SFT data by the singular-value spectra of per-sample layer-wise gradients.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    argv = _joined(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    try:
        command_parser, from_config = sub.choices[args.command], {}
        if getattr(args, "config", None):  # the file's options as defaults; the flags given win
            from_config = config_values(args.config, command_parser, args.command)
            command_parser.set_defaults(**from_config)
            args = parser.parse_args(argv)
        args.given = given_options(command_parser, argv[argv.index(args.command) + 1:], set(from_config))
        return COMMANDS[args.command].run(args)
    except (InputError, ValueError, OSError, RuntimeError) as e:
        print(f"gradspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
