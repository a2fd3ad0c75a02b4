"""`gradspec env`: which paths this machine has, its devices, threads and versions (for bug reports)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from gradspec.cli.options import add_options
from gradspec.environment import environment
from gradspec.options import option


@dataclass(frozen=True, kw_only=True)
class Shown:
    """How env shows what it finds (gradspec.options)."""

    json: bool = option(False, "as JSON", kind="bool")


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="this machine's paths, devices, threads and versions (paste it into bug reports)")
    add_options(p, Shown)


def _lines(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        return [line for key, v in value.items() for line in _lines(v, f"{prefix}{key}.")] if value else \
            [f"{prefix[:-1]}: none"]
    if isinstance(value, list):
        return [line for i, v in enumerate(value) for line in _lines(v, f"{prefix}{i}.")] if value else \
            [f"{prefix[:-1]}: none"]
    return [f"{prefix[:-1]}: {value}"]


def run(args: argparse.Namespace) -> int:
    info = environment()
    print(json.dumps(info, indent=2) if args.json else "\n".join(_lines(info)))
    return 0
