"""Command-line flags made from declared options (gradspec.options): each option's flag, type,
choices, default and help come from its field, so a field added to a config is a flag of every
command that takes that config, a key of its --config files and a line of its --help."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any

from gradspec.options import Declared, declared

_TYPES = {"int": int, "float": float}


def add_options(parser: argparse.ArgumentParser, cls: type, skip: Collection[str] = (),
                defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None) -> None:
    """A flag for each of cls's options but those in skip (by name); defaults and helps: this
    command's own where they differ from the field's."""
    for d in declared(cls):
        if d.name in skip:
            continue
        default = (defaults or {}).get(d.name, d.default)
        help_text = (helps or {}).get(d.name, d.option.flag_help or d.option.help) or None
        kind = d.option.kind.rstrip("?")
        if kind == "bool":
            action: Any = ("store_true" if not default else "store_false" if d.option.flag
                           else argparse.BooleanOptionalAction)
            parser.add_argument(d.flag, dest=d.name, action=action, default=default, help=help_text)
        elif kind == "pairs":
            parser.add_argument(d.flag, dest=d.name, nargs="+", default=default, help=help_text, metavar="KEY=VALUE")
        else:
            parser.add_argument(d.flag, dest=d.name, type=_TYPES.get(kind), choices=d.option.choices,
                                default=default, help=help_text, metavar=_key(d).upper() if d.option.flag else None)


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
