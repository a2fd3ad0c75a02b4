"""Rows given in memory to gradspec.score and gradspec.align (a list of dicts, a pandas DataFrame, a
``datasets.Dataset``), read as a file's rows are: the same layouts, field mapping and checks, each
error naming the row as ``data[3]`` (``task[3]``) where a file's names its line.

A run's config names its input by a plain string (a run folder's manifest records it), so rows given
in memory are named by a label of their content, ``<in-memory: 12 rows, sha256 1a2b3c4d5e6f7a8b>``:
a resume with the same rows continues, other rows are another input and are refused. The readers
(gradspec.data.formats) find the rows of a label here, while ``holding`` holds them: for the call
that was given them, and no longer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import reprlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from gradspec.data.errors import InputError
from gradspec.data.hub import dataset_records

_LABEL = re.compile(r"<in-memory: \d+ rows?, sha256 [0-9a-f]{16}>")
KINDS = "a list of dicts, a pandas DataFrame, a datasets.Dataset"  # what rows in memory may be
_held: dict[str, tuple[InMemoryRows, int]] = {}  # label -> (its rows, how many holding calls hold them)
_holding = threading.Lock()  # calls in threads may hold the same rows


class InMemoryRows:
    """One input's rows, held in memory; name ("data", "task") is what their errors call the input."""

    def __init__(self, rows: Any, name: str) -> None:
        self.name = name
        self._dataset = rows if _is_dataset(rows) else None
        if _is_data_frame(rows):
            self._rows: list[Any] = [{k: v for k, v in row.items() if not _missing(v)}
                                     for row in rows.to_dict("records")]  # a missing cell: no field, as in Parquet
        else:
            self._rows = [] if self._dataset is not None else list(rows)
        digest = hashlib.sha256()  # of what the readers see: a field that is None is no field, the fields' order aside
        for _, row in self._rows_read():
            seen = {k: v for k, v in _record(row).items() if v is not None} if isinstance(row, Mapping) else row
            # ASCII escapes: a lone surrogate (a malformed row, the readers' to flag) has no UTF-8 to hash
            digest.update(json.dumps(seen, sort_keys=True, default=str).encode() + b"\n")
        self.label = f"<in-memory: {len(self)} row{'s' * (len(self) != 1)}, sha256 {digest.hexdigest()[:16]}>"

    def __len__(self) -> int:
        return len(self._dataset if self._dataset is not None else self._rows)

    def records(self, wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[str, dict | InputError | None]]:
        """(location, record) per row, as formats.read_records gives a file's: a row that is no mapping
        comes back as the InputError that says so; None for rows that wanted(index) rejects."""
        for index, (where, row) in enumerate(self._rows_read(wanted)):
            if wanted is not None and not wanted(index):
                yield where, None
            elif isinstance(row, Mapping):
                yield where, _record(row)
            else:
                yield where, InputError(f"{where}: expected a dict of fields, got {type(row).__name__}")

    def _rows_read(self, wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[str, Any]]:
        """(location, the row as given) per row; a Dataset's rows that wanted(index) rejects are not read."""
        if self._dataset is not None:
            yield from dataset_records(self._dataset, self._locate, wanted)
        else:
            yield from ((self._locate(i), row) for i, row in enumerate(self._rows))

    def _locate(self, index: int) -> str:
        return f"{self.name}[{index}]"


def is_rows(value: Any) -> bool:
    """Whether value is rows given in memory: a list or tuple (of rows), a DataFrame or a Dataset."""
    return isinstance(value, (list, tuple)) or _is_data_frame(value) or _is_dataset(value)


def is_label(path: Any) -> bool:
    """Whether a path names rows given in memory (their label), held now or not."""
    return isinstance(path, (str, os.PathLike)) and _LABEL.fullmatch(os.fspath(path)) is not None


def held(path: Any) -> InMemoryRows | None:
    """The rows a label names, while a call holds them; None for any other path."""
    entry = _held.get(os.fspath(path)) if is_label(path) else None
    return None if entry is None else entry[0]


def check_held(path: Any) -> InMemoryRows:
    """The rows a label names, or an InputError: they are read only inside the call they were given to."""
    rows = held(path)
    if rows is None:
        raise InputError(f"{path}: rows given in memory to gradspec.score or gradspec.align, read only inside that "
                         "call; to continue its run, call it again with the same rows")
    return rows


@contextmanager
def holding(**inputs: Any) -> Iterator[dict[str, Any]]:
    """Each input (name=value) that is rows in memory as its label, the rows held for the readers until the
    block ends; any other input as given, or a TypeError that names it where it is neither a path nor rows."""
    given: dict[str, Any] = {}
    labels: list[str] = []
    try:
        for name, value in inputs.items():
            if not is_rows(value):
                if value is not None and not isinstance(value, (str, os.PathLike)):
                    raise TypeError(f"{name} must be a str, a pathlib.Path, {KINDS} or None, got "
                                    f"{type(value).__name__} {reprlib.repr(value)}")
                given[name] = value
                continue
            rows = InMemoryRows(value, name)
            with _holding:
                held_rows, count = _held.get(rows.label, (rows, 0))
                _held[rows.label] = (held_rows, count + 1)
            labels.append(rows.label)
            given[name] = rows.label
        yield given
    finally:
        with _holding:
            for label in labels:
                rows, count = _held.pop(label)
                if count > 1:
                    _held[label] = (rows, count - 1)


def _record(row: Mapping) -> dict:
    """A row as the readers take a record: a dict of str keys, numpy's values as Python's."""
    return {str(k): plain_value(v) for k, v in row.items()}


def plain_value(value: Any) -> Any:
    """numpy's scalars and arrays (a DataFrame's cells, a Parquet or datasets input's values) as JSON and
    the readers take them: Python numbers and lists."""
    numpy = sys.modules.get("numpy")  # not loaded: no value is numpy's
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value.tolist()
    return value.item() if numpy is not None and isinstance(value, numpy.generic) else value


def _missing(value: Any) -> bool:
    """A DataFrame's mark of a missing cell: None, NaN, pandas' NA or NaT."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    pandas = sys.modules.get("pandas")
    return pandas is not None and (value is pandas.NA or value is pandas.NaT)


def _is_data_frame(value: Any) -> bool:
    pandas = sys.modules.get("pandas")  # not loaded: no value is a DataFrame
    return pandas is not None and isinstance(value, pandas.DataFrame)


def _is_dataset(value: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(value, datasets.Dataset)
