"""Command-line flags made from declared options (gradspec.options): each option's flag, type,
choices, default and help come from its field, so a field added to a config is a flag of every
command that takes that config, a key of its --config files and a line of its --help."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from gradspec.options import Declared, declared

_TYPES = {"int": int, "float": float}


def add_options(parser: argparse.ArgumentParser, cls: type, skip: Collection[str] = (),
                defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
                only: Collection[str] | None = None) -> None:
    """A flag for each of cls's options but those in skip (by name; with only: those alone, to place them
    apart in --help); defaults and helps: this command's own where they differ from the field's."""
    exclusive: dict[str, Any] = {}
    for d in declared(cls):
        if d.name in skip or (only is not None and d.name not in only):
            continue
        opt, default = d.option, (defaults or {}).get(d.name, d.default)
        help_text = (helps or {}).get(d.name, opt.flag_help or opt.help) or None
        where: Any = parser
        if opt.one_of is not None:  # one of a set: required says that one must be given
            if opt.one_of not in exclusive:
                exclusive[opt.one_of] = parser.add_mutually_exclusive_group(required=opt.required)
            where = exclusive[opt.one_of]
        what: dict[str, Any] = {"default": default, "help": help_text}
        if not opt.positional:
            what["dest"] = d.name
            if opt.required and opt.one_of is None:
                what["required"] = True
        kind = opt.kind.rstrip("?")
        if kind == "bool":
            what["action"] = ("store_true" if not default else "store_false" if opt.flag
                              else argparse.BooleanOptionalAction)
        else:
            what.update(type=_reader(d) if opt.parse else _TYPES.get(kind), choices=opt.choices,
                        metavar=opt.metavar or ("KEY=VALUE" if kind == "pairs" else
                                                _key(d).upper() if opt.flag else None))
            if opt.many or kind == "pairs":
                what["nargs"] = "+"
        where.add_argument(d.flag, **what)


def _reader(d: Declared) -> Any:
    """The option's parse as argparse's type: its ValueError the flag's error, in its words."""
    def read(text: str) -> Any:
        try:
            return d.option.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = d.name  # argparse names the type in an error it did not word
    return read


def shows_progress(wanted: bool) -> bool:
    """Whether a command's progress bars show, the one rule of every command: where they are wanted (no
    --quiet) and stderr, where tqdm writes them, is a terminal (a log file or a pipe gets none)."""
    return wanted and sys.stderr.isatty()


@contextmanager
def library_bars(shown: bool, loads_models: bool) -> Iterator[None]:
    """transformers' own bars (loading weights, writing shards, Trainer's steps) follow the same rule while
    a command that loads a model runs. transformers is not imported for this (an argument error must come
    before it loads): where it is imported already, its bars are put back after the command; where not yet,
    Hugging Face's variable HF_HUB_DISABLE_PROGRESS_BARS is set for the command, which Hugging Face reads
    once, on import, so its bars stay off for the rest of that process (a command line runs one command)."""
    if shown or not loads_models:
        yield
        return
    logging = sys.modules.get("transformers.utils.logging")
    if logging is not None:
        was = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                logging.enable_progress_bar()
        return
    variable = "HF_HUB_DISABLE_PROGRESS_BARS"
    before = os.environ.get(variable)
    os.environ[variable] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before


def options_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """cls's keyword arguments from the parsed flags it has (a group's gathered into a dict of its
    fields); an option without a flag in this command is left to its default."""
    values: dict[str, Any] = {}
    for d in declared(cls):
        if not hasattr(args, d.name):
            continue
        if d.group is None:
            values[d.field.name] = getattr(args, d.name)
        else:
            values.setdefault(d.group.name, {})[d.field.name] = getattr(args, d.name)
    return values


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's name (its dest) -> the flag that gives it: how the command line names it."""
    return {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}


def run_flags(items: Mapping[str, Any], cls: type, fields: Collection[str]) -> dict[str, Any]:
    """A config's values (cls's field names, a group's as a dict), of these fields only, by the
    names of their flags without dashes: how a --config file names options."""
    out: dict[str, Any] = {}
    for d in declared(cls):
        if d.group is not None and d.group.name in fields:
            out[_key(d)] = items[d.group.name][d.field.name]
        elif d.group is None and d.field.name in fields:
            out[_key(d)] = items[d.field.name]
    return out


def _key(d: Declared) -> str:
    return d.flag.lstrip("-").replace("-", "_")
