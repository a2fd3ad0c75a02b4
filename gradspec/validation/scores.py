"""The scores validate tests, read from gradspec's files: an attribution matrix (`gradspec align
--attribution`: one list per training row, one value per target example) or one value per training
row (any numeric column of a score or align file, a metric averaged over modules, or a select --by
expression). Every problem is one line naming the file and the field."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from gradspec.analysis.select import combined_score, criteria, row_indices
from gradspec.data.errors import InputError
from gradspec.files import parquet_errors
from gradspec.options import OptionError
from gradspec.runs.score_files import ATTRIBUTION, module_columns, parquet_schema, schema_metadata

log = logging.getLogger("gradspec")
READING = ("max_length", "template")  # how a row becomes tokens: a score and its retrains should agree
POOL = "pool the retrains drew from"  # what a score's index numbers the rows of


@dataclass(frozen=True)
class Score:
    """A score as the analysis uses it. values: (rows, targets) for an attribution, (rows, 1) for a
    per-sample score, by training row index, NaN where a row has none; missing: its NaN cells."""

    name: str
    path: str
    column: str
    values: np.ndarray
    missing: int

    @property
    def per_target(self) -> bool:
        return self.column == ATTRIBUTION

    def per_sample(self) -> np.ndarray:
        """One value per row: the score itself, or an attribution's mean over targets (a row that helps
        the task on average), NaN where a row has none."""
        with np.errstate(all="ignore"):
            return self.values[:, 0] if not self.per_target else _nanmean_rows(self.values)


def split_spec(spec: str) -> tuple[str, str | None]:
    """'FILE[:COLUMN]' -> (file, column or None); the file is the shortest prefix before a ':' that is a
    file (a column may hold colons: a select --by combination 'a:1,b:-1')."""
    if Path(spec).is_file():
        return spec, None
    for at in (i for i, c in enumerate(spec) if c == ":"):
        if Path(spec[:at]).is_file():
            return spec[:at], spec[at + 1:] or None
    path, _, column = spec.partition(":")  # no such file: the caller names it
    return path, column or None


def read_score(spec: str, rows: int, targets: int, pool: dict[str, Any] | None = None) -> Score:
    """The score spec FILE[:COLUMN] names, for a pool of rows training rows and targets target examples.
    Without a column, the file's attribution column. pool: what the retrains record of their data (data,
    data_bytes), which a score file must have scored (check_pool_data). Raises InputError naming the file
    and the field."""
    path, column = split_spec(spec)
    schema = parquet_schema(path, "pass a score file: gradspec score, align or align --attribution's output")
    if pool is not None:
        check_pool_data(path, schema_metadata(schema), pool)
    column = column or ATTRIBUTION
    if "index" not in schema.names:
        raise InputError(f"{path}: no index column (the training row of each score); pass a file gradspec wrote")
    with parquet_errors(path):
        if column == ATTRIBUTION:
            values = _attribution(path, schema, rows, targets)
        else:
            values = _per_sample(path, column, rows)[:, None]
    values[~np.isfinite(values)] = np.nan  # inf is no value either: counted as missing, not summed
    name = Path(path).stem + ("" if column == ATTRIBUTION else f":{column}")
    return Score(name, path, column, values, int(np.isnan(values).sum()))


def check_pool_data(path: str, scored: dict[str, Any], pool: dict[str, Any]) -> None:
    """A score numbers the rows of the data the retrains drew their pool from: a score file that recorded
    other data (of another size; where no size is known, of another name) is refused, naming both. A file
    that recorded none (another tool's) is taken as it is."""
    data, size = scored.get("data"), scored.get("data_bytes")
    if data is None or pool.get("data") is None:
        return
    other = size != pool.get("data_bytes") if size is not None and pool.get("data_bytes") is not None else \
        data != pool["data"]
    if other:
        raise InputError(f"{path}: scored {data}" + (f" ({size} bytes)" if size is not None else "")
                         + f", but the retrains drew their pool from {pool['data']}"
                         + (f" ({pool['data_bytes']} bytes)" if pool.get("data_bytes") is not None else "")
                         + ": its index numbers other rows; pass a score file of the pool's data")
    _check_reading(path, scored, pool)


def _check_reading(path: str, scored: dict[str, Any], pool: dict[str, Any]) -> None:
    """A score made of other tokens than the retrains trained on (another --max-length, another --template)
    still numbers the pool's rows, but measures what the retrains did not see: said, not refused."""
    differ = [f"--{key.replace('_', '-')} {scored[key]} there, {pool[key]} in the retrains" for key in READING
              if scored.get(key) is not None and pool.get(key) is not None and scored[key] != pool[key]]
    if differ:
        log.warning("%s: scored with %s: its rows were read otherwise than the retrains read them (a row longer "
                    "than the shorter cut is scored on tokens one side never saw); score again with the retrains' "
                    "settings for a like-for-like test", path, ", ".join(differ))


def _listed(names: list[str], most: int = 12) -> str:
    """A file's columns for an error: the first most, and how many more there are."""
    more = len(names) - most
    return ", ".join(names[:most]) + (f", … ({more} more)" if more > 0 else "")


def _attribution(path: str, schema: pa.Schema, rows: int, targets: int) -> np.ndarray:
    if ATTRIBUTION not in schema.names:
        raise InputError(f"{path}: no attribution column (from gradspec align --attribution); name a per-sample "
                         f"column as {path}:COLUMN instead (its columns: {_listed(schema.names)})")
    kind = schema.field(ATTRIBUTION).type
    if not (_is_list(kind) and (pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)
                                or pa.types.is_null(kind.value_type))):
        raise InputError(f"{path}: its attribution column holds {kind}, not a list of numbers per row (gradspec "
                         "align --attribution's); pass that file")
    frame = pd.read_parquet(path, columns=["index", ATTRIBUTION])
    out = np.full((rows, targets), np.nan)
    for i, value in zip(row_indices(path, frame, rows, POOL), frame[ATTRIBUTION], strict=True):
        if value is None:
            continue
        if len(value) != targets:
            raise InputError(f"{path}: attribution of index {i} has {len(value)} values, but the retrains measured "
                             f"{targets} target examples; pass the attribution made against the same --target")
        out[i] = np.asarray(value, dtype=float)
    return out


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _per_sample(path: str, column: str, rows: int) -> np.ndarray:
    frame = pd.read_parquet(path)
    try:
        names = [name for name, _ in criteria(column)]
        unknown = [n for n in names if n not in frame.columns and n != "alignment" and
                   not module_columns(frame.columns, n)]
        if unknown:
            raise InputError(f"{path}: no column {unknown[0]!r} (nor a metric of its modules); its columns: "
                             f"{_listed([c for c in frame.columns if '/' not in c])}")
        values = combined_score(frame, column)
    except OptionError as e:  # select's, which names --by: here the field is the spec's column
        raise InputError(f"{path}: {column}: {e.text}") from None
    out = np.full(rows, np.nan)
    out[row_indices(path, frame, rows, POOL)] = values.to_numpy(dtype=float)
    return out


def _nanmean_rows(values: np.ndarray) -> np.ndarray:
    counts = np.isfinite(values).sum(1)
    sums = np.nansum(values, 1)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
