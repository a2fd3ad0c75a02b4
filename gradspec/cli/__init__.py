"""gradspec command line: one module per command, each with add_parser(sub) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import NoReturn

from gradspec.cli.config_file import config_values
from gradspec.cli.given import given_options
from gradspec.cli.options import flags_of, library_bars, shows_progress
from gradspec.errors import InputError
from gradspec.options import OptionError, declared, nearest

_NAMES = ("score", "ray-score", "align", "project", "select", "report", "merge", "train", "dynamics", "diagnose",
          "validate", "env")
LOADS_MODELS = {"score", "ray-score", "align", "project", "train", "dynamics", "diagnose", "validate"}


class _Commands(Mapping[str, ModuleType]):
    """Each command's module (gradspec.cli.<name>), imported on first use: a command line loads
    only its own command's modules, so that --help and argument errors come at once."""

    def __getitem__(self, name: str) -> ModuleType:
        if name not in _NAMES:
            raise KeyError(name)
        return importlib.import_module(f"gradspec.cli.{name.replace('-', '_')}")

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


COMMANDS = _Commands()


def _joined(argv: list[str]) -> list[str]:
    """argv with '--shard V' as '--shard=V': argparse takes a V that starts with '-' for an option."""
    out: list[str] = []
    for token in argv:
        if out and out[-1] == "--shard" and token.startswith("-"):
            out[-1] = f"--shard={token}"
        else:
            out.append(token)
    return out


def _unshown(default: object) -> bool:
    """A default that says nothing in a help line: none, off, suppressed (0 is shown: 0 == False)."""
    return default is None or default is False or default is argparse.SUPPRESS


class _WithDefaults(argparse.HelpFormatter):
    """Every option's default in its help, where the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or "default" in text or _unshown(action.default):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """argparse's errors in one line like every other error (not its usage block), with the help
    to read, and the nearest option for one that does not exist; every default in the help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _WithDefaults)
        kwargs.setdefault("allow_abbrev", False)  # a prefix guesses: --output was read as --output-field
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        for action in self._actions:  # argparse shows nothing for an option without help, not even its default
            if action.help is None and action.option_strings and not _unshown(action.default):
                action.help = "(default: %(default)s)"
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            options = [o for a in self._actions for o in a.option_strings]
            for arg in message.removeprefix("unrecognized arguments: ").split():
                meant = _meant(arg.partition("=")[0], options) if arg.startswith("--") else []
                message += f" ({arg}: did you mean {' or '.join(meant)}?)" if meant else ""
        self.exit(2, f"gradspec: error: {message}; see {self.prog} -h\n")


def _meant(word: str, options: list[str]) -> list[str]:
    """The options a mistyped or shortened one may have meant: the nearest, else those it begins or ends
    (--output: --out or --output-field)."""
    near = nearest(word, options)
    if near is not None:
        return [near]
    return sorted(o for o in options if o.startswith("--") and (o.startswith(word) or word.startswith(o)))[:3]


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler's or torchrun's stop) ends the command as Ctrl-C does, through its
    finally blocks: temporaries removed, locks released, nothing left half-written. Only where the
    signal has its default action (a program that calls main keeps its own handler), and only while
    main runs."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminated(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt("terminated")


# Thread pools that sleep when idle rather than spin: on a shared machine a spinning OpenMP barrier waits out
# whole time slices of a thread the kernel has descheduled (measured: up to 100x the quiet time beside a CPU hog
# on 2 cores; benchmarks/throughput/bench_contention.py). NumPy's and SciPy's OpenBLAS (two pools of their own
# beside torch's OpenMP) get one thread: their work here is small, and the extension holds them at one thread anyway.
POLITE_THREADS = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "1"}


def polite_threads() -> None:
    """POLITE_THREADS where the user has not set them, read by the libraries when they load (so only
    before torch and NumPy are)."""
    if "torch" in sys.modules or "numpy" in sys.modules:
        return
    for name, value in POLITE_THREADS.items():
        os.environ.setdefault(name, value)


def console() -> int:
    """The `gradspec` command (and `python -m gradspec`): its own process, whose thread pools it may set
    (polite_threads); a program that calls main keeps its environment as it is."""
    polite_threads()
    return main()


def main(argv: list[str] | None = None) -> int:
    try:
        with _sigterm_as_interrupt():
            return _main(argv)
    except KeyboardInterrupt as e:  # one line, not a traceback
        stopped = "terminated" if e.args == ("terminated",) else "interrupted"
        kept = getattr(e, "kept", None)
        print(f"gradspec: {stopped}" + (f" ({kept})" if kept else ""), file=sys.stderr)
        return 143 if stopped == "terminated" else 130


class _NoDeepSpeedCpuNotice(logging.Filter):
    """deepspeed, which transformers imports wherever it is installed, warns on every run without a GPU that it
    found none ("Setting accelerator to CPU"): gradspec asked nothing of it (its own record, before it is made)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def _quiet_deepspeed() -> None:
    deepspeed = logging.getLogger("DeepSpeed")  # the logger deepspeed makes, found by name before it does
    if not any(isinstance(f, _NoDeepSpeedCpuNotice) for f in deepspeed.filters):
        deepspeed.addFilter(_NoDeepSpeedCpuNotice())


def _main(argv: list[str] | None) -> int:
    _quiet_deepspeed()
    parser = _Parser(
        prog="gradspec", description="Score SFT data by the singular-value spectra of per-sample layer-wise gradients.")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = _joined(sys.argv[1:] if argv is None else list(argv))
    chosen = next((token for token in argv if not token.startswith("-")), None)
    if chosen is not None and chosen not in COMMANDS:  # named at once, before any command's modules load
        near = nearest(chosen, _NAMES)
        parser.error(f"argument command: invalid choice: {chosen!r} ({f'did you mean {near}? ' if near else ''}"
                     f"choose from {', '.join(_NAMES)})")
    for name in [chosen] if chosen in COMMANDS else COMMANDS:  # all of them for `gradspec -h`
        COMMANDS[name].add_parser(sub)
    args = _parse(parser, sub, argv)
    try:
        command_parser, from_config = sub.choices[args.command], {}
        own = argv[argv.index(args.command) + 1:]
        if getattr(args, "config", None):  # the file's options as defaults; the flags given win
            from_config = config_values(args.config, command_parser, args.command,
                                        set(given_options(command_parser, own)))
            command_parser.set_defaults(**from_config)
            args = _parse(parser, sub, argv)
        args.given = given_options(command_parser, own, set(from_config))
        with library_bars(shows_progress(getattr(args, "progress", True)), args.command in LOADS_MODELS):
            return COMMANDS[args.command].run(args)
    except KeyboardInterrupt as e:
        e.kept = _kept(args)
        raise
    except OptionError as e:  # named as the command line names it
        print(f"gradspec: error: {e.named(_flags(sub.choices[args.command]))}", file=sys.stderr)
        return 2
    except (InputError, ValueError, OSError, RuntimeError) as e:
        print(f"gradspec: error: {e}", file=sys.stderr)
        return 2


def _kept(args: argparse.Namespace) -> str | None:
    """What a command stopped by Ctrl-C or SIGTERM leaves to continue from: a run's finished parts, each
    written whole (validate's: one a retrain), which the same command with --resume takes up."""
    if args.command in ("score", "project") or (args.command == "align" and not args.store):
        return "a scoring run keeps the parts it finished: the same command with --resume continues it"
    if args.command == "validate" and not args.runs:
        return "validate keeps the retrains it finished: the same command with --resume continues them"
    return None


def _flags(command: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's flag: this command's own, else a run's (a merge's errors name score's flags)."""
    from gradspec.runs.config import RunSettings, ScoreConfig

    runs = {d.name: d.flag for cls in (ScoreConfig, RunSettings) for d in declared(cls)}
    return {**runs, "shard": "--shard", **flags_of(command)}


def _parse(parser: argparse.ArgumentParser, sub, argv: list[str]) -> argparse.Namespace:
    """The arguments; an unknown one is reported by its command's parser, which knows its options."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
