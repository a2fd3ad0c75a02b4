"""`gradspec env`: which paths this machine has, its devices, threads and versions (for bug reports)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gradspec.environment import environment


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="this machine's paths, devices, threads and versions (paste it into bug reports)")
    p.add_argument("--json", action="store_true", help="as JSON")


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
