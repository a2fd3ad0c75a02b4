"""Which options a command was given (on its command line or in --config), so that an option given
where it has no effect is refused instead of silently ignored, even when its value is the default."""

from __future__ import annotations

import argparse
import copy


def given_options(parser: argparse.ArgumentParser, argv: list[str], from_config: set[str] = frozenset()
                  ) -> dict[str, str]:
    """dest -> flag of each option argv (the command's own arguments) or the config file gives."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:  # a default of SUPPRESS: only what argv gives reaches the namespace
        action.default = argparse.SUPPRESS
    named = set(vars(probe.parse_args(argv))) | set(from_config)
    return {a.dest: a.option_strings[-1] for a in parser._actions if a.dest in named and a.option_strings}


def refuse_unused(args: argparse.Namespace, dests: tuple[str, ...], applies: bool, why: str) -> None:
    """Refuses the options among dests that were given, unless they apply: 'flags have no effect why'."""
    named = [flag for dest, flag in getattr(args, "given", {}).items() if dest in dests]
    if named and not applies:
        verb, it = ("has", "it") if len(named) == 1 else ("have", "them")
        raise ValueError(f"{', '.join(named)} {verb} no effect {why}; drop {it}")
