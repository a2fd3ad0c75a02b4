"""The type of each carried column in the output. A carried column keeps its values' type where they
all have one (numbers: ints and floats are one kind, stored as numbers); a column whose values mix kinds
(an ``id`` that is 7 in one row and "a7" in another, a bool beside numbers) or holds an int too large
for 64 bits is stored as text: each value as the input wrote it (JSON's spelling: 7 -> "7", true ->
"true"), nulls as nulls. For a JSON or JSONL file the kinds are those of the whole input (up to the
limit: ``mixed_columns_of``), so every chunk of a run stores the column with the same type however the
run is split, and the parts merge; a Parquet file or a `datasets` split has one type per column already.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from gradspec.data import in_memory
from gradspec.data.hub import Hub
from gradspec.data.readers import read_samples
from gradspec.data.row_layouts import Fields
from gradspec.data.sample import Sample


def _kind(value: Any) -> str:
    """A carried value's kind: null, bool, number (an int within 64 bits or a float), str, or big (an
    int beyond 64 bits, which only text holds)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "number" if -(2**63) <= value < 2**63 else "big"
    return "number" if isinstance(value, float) else "str"


def mixed_columns(samples: Iterable[Sample]) -> set[str]:
    """The carried columns stored as text: their values (nulls aside) are of more than one kind, or
    an int beyond 64 bits (see the module's docstring)."""
    kinds: dict[str, set[str]] = {}
    for s in samples:
        for name, value in s.carried.items():
            kinds.setdefault(name, set()).add(_kind(value))
    return {name for name, found in kinds.items() if len(found - {"null"}) > 1 or "big" in found}


def as_text(value: Any) -> str | None:
    """A carried value of a column stored as text: a string as it is, another value as JSON spells it."""
    return value if value is None or isinstance(value, str) else json.dumps(value)


def with_text_columns(sample: Sample, columns: set[str]) -> Sample:
    """The sample with its values of these carried columns as text (as_text); the sample itself where
    it has none of them."""
    if not columns & sample.carried.keys():
        return sample
    return replace(sample, carried={k: as_text(v) if k in columns else v for k, v in sample.carried.items()})


def mixed_columns_of(path: str | Path | None, fields: Fields = Fields(), limit: int | None = None,
                     hub: Hub = Hub()) -> set[str]:
    """mixed_columns over the whole input (its rows up to limit; malformed ones left out) for a JSON
    or JSONL file or rows given in memory, whose rows may give a column any type; empty for other inputs
    (a Parquet file or a `datasets` split types each column once). Read once per version of the file
    (per content of rows in memory: their label)."""
    if in_memory.is_label(path):
        return set(_mixed_columns_of(str(path), 0, 0, fields, limit, hub))
    if path is None or Path(path).is_dir() or Path(path).suffix not in (".json", ".jsonl") or not Path(path).is_file():
        return set()
    stat = os.stat(path)
    return set(_mixed_columns_of(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, fields, limit, hub))


@lru_cache(maxsize=8)
def _mixed_columns_of(path: str, size: int, mtime_ns: int, fields: Fields, limit: int | None,
                      hub: Hub) -> frozenset[str]:
    return frozenset(mixed_columns(read_samples(path, fields, limit, on_error="skip", hub=hub)))
