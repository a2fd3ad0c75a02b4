"""Score files: Parquet, one row per input sample in input order, with the run described in its metadata."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from gradspec.choices import METRICS
from gradspec.data.errors import InputError
from gradspec.data.templates import SCORED
from gradspec.files import atomic_write, open_regular, parquet_errors, write_checksummed
from gradspec.options import OptionError

if TYPE_CHECKING:  # torch loads only where a file is written: select, report and merge read without it (225 MB)
    import torch

    from gradspec.layers.targets import Part

BASE_COLUMNS = ("index", "status", "error", "loss", "num_tokens", "num_response_tokens")
SPECTRA = "singular_values"
ROUTED_TOKENS = "routed_tokens"  # per expert, "<experts module>.<e>/routed_tokens": the sample's tokens sent there
ATTRIBUTION = "attribution"  # align --attribution's column: per task file row, the inner product with its gradient
PROJECTION = "projected_gradient"  # a store's column: gradspec.alignment.projection's values, fp32
METADATA_KEY = b"gradspec"
# About this many bytes of a file's columns are read at once (read_batches): a million rows of a 7B model's
# 1,349 columns are 11 GB, so whole reads of them do not fit in memory.
BATCH_BYTES = 64 << 20


def complete(status: pd.Series) -> pd.Series:
    """Rows whose every metric was computed: no flag but the tokenizer's flags of scored rows
    (templates.SCORED), no numeric one. They compete in a selection and enter a report. Each distinct
    status is judged once (a million rows hold a few)."""
    return status.map({s: set(s.split(";")) <= set(SCORED) for s in status.unique()})


def column(part: str, metric: str) -> str:
    return f"{part}/{metric}"


def metric_columns(metrics: dict[str, torch.Tensor], i: int, names: tuple[str, ...]) -> dict[str, float]:
    """Row i of per-module metric tables as output columns: {"<module>/<metric>": value}."""
    from gradspec.linalg.metrics import metrics_dict

    return {column(name, m): v for name, values in metrics.items() for m, v in metrics_dict(values[i], names).items()}


def module_columns(columns: Iterable[str], metric: str) -> list[str]:
    """Every module's column of a metric ("<module>/<metric>"), in the given order."""
    return [c for c in columns if c.endswith("/" + metric)]


def module_mean(frame: pd.DataFrame, metric: str) -> pd.Series:
    """Per row, a metric averaged over every module that has a column of it: NaN values are
    skipped; NaN where all are, or where no module has the metric."""
    return frame[module_columns(frame.columns, metric)].astype(float).mean(axis=1)


def carried_name(name: str) -> str:
    """Input columns keep their name unless it would clash with ours."""
    ours = name in BASE_COLUMNS or name == PROJECTION or name.startswith("align_") or "/" in name
    return f"input_{name}" if ours else name


def file_metadata(parts: list[Part], metrics: tuple[str, ...], run_info: dict[str, Any]) -> dict[str, Any]:
    """What a score file says of its run, under METADATA_KEY in the Parquet schema."""
    from gradspec.layers.targets import layer_index

    modules = [{"name": p.name, "role": p.role, "layer": layer_index(p.name), "d_in": p.d_in, "d_out": p.d_out}
               for p in parts]
    return {"parts": modules, "metrics": list(metrics), **run_info}


def write_parquet(table: pa.Table | pd.DataFrame, path: str | Path, metadata: dict[str, Any] | None = None,
                  checksummed: bool = False) -> None:
    """A table, or a DataFrame without its index, written to path atomically (atomic_write; checksummed: with
    its SHA-256 beside it, write_checksummed); with metadata, that as JSON under METADATA_KEY beside the
    schema's own (pandas') metadata."""
    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    if metadata is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               METADATA_KEY: json.dumps(metadata).encode()})
    (write_checksummed if checksummed else atomic_write)(path, lambda f: pq.write_table(table, f))


def parquet_schema(path: str | Path, what: str) -> pa.Schema:
    """The schema of a Parquet file gradspec wrote, or an error that says what the path is instead
    and what to pass (what)."""
    path = Path(path)
    if path.is_dir():
        hint = ""
        if path.name.endswith(".parts"):  # a scoring run's folder has its manifest; a training monitor's, parts alone
            hint = " (an unfinished run? gradspec merge --out the run's --out)" if (path / "manifest.json").exists() \
                else " (a training monitor's parts? gradspec.read_monitor reads them)"
        raise InputError(f"{path}: a folder, not a Parquet file{hint}; {what}")
    if not path.exists():
        raise InputError(f"{path}: no such file; {what}")
    with open_regular(path, what) as f, parquet_errors(path, what):
        schema = pq.read_schema(f)
        schema_metadata(schema)  # JSON every caller reads: damaged, it is named here
    return schema


def schema_metadata(schema: pa.Schema) -> dict[str, Any]:
    """What gradspec recorded in a Parquet file's schema (empty for a file it did not write)."""
    return json.loads((schema.metadata or {}).get(METADATA_KEY, b"{}"))


def read_metadata(path: str | Path) -> dict[str, Any]:
    """What a score file says of its run: model, data, template, modules, parts, metrics, ...; or an
    error that says what the path is instead.

    Args:
        path: A score file (the --out of gradspec score, align or project, or of the API's score).

    Returns:
        The run's metadata as recorded; "parts" lists each scored part's name, role, layer, d_in
        and d_out, "metrics" the metric columns per part, in order.

    Raises:
        InputError: path is a folder, missing, not Parquet, or another kind of file.
    """
    what = "pass a score file (the --out of gradspec score, align or project)"
    schema = parquet_schema(path, what)
    if "status" not in schema.names:
        raise InputError(f"{path}: no 'status' column, so not a gradspec score file; {what}")
    meta = schema_metadata(schema)
    if "parts" not in meta:  # every scoring run records its modules
        kind = "a dynamics file" if "checkpoints" in meta else \
            "a training monitor's file (gradspec.read_monitor reads it)" if "micro_batch" in schema.names else \
            "a Parquet file of another kind"
        raise InputError(f"{path}: {kind}, not a score file; {what}")
    return meta


def check_scored_input(meta: dict[str, Any], data: str | Path, scores: str | Path) -> None:
    """data is the file the score file (its metadata: meta) scored: a file of another size is
    another input, or one changed since, whose rows the scores do not describe."""
    scored = meta.get("data_bytes")
    if scored is not None and Path(data).is_file() and Path(data).stat().st_size != scored:
        raise InputError(f"{data}: {Path(data).stat().st_size} bytes, but the input {scores} scored had {scored}: "
                         "not that input, or changed since; pass the file that was scored, or score this one")


def read_scores(path: str | Path, *, modules: Iterable[str] | None = None, metrics: Iterable[str] | None = None,
                columns: Iterable[str] | None = None, progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(wide, long): the file as a DataFrame, and one row per (sample, layer, module, metric).

    The long form has a row per value: 1,344 a sample for a 7B model with every module, over a
    billion for a million samples. For a large file give modules, metrics or columns, which read
    only those columns, in batches; or use iter_scores, which yields the same frames batch by batch.

    Args:
        path: A score file, as for read_metadata.
        modules: Only these parts: each a part's name, its role (q, k, v, o, gate, up, down, ...)
            or a glob of names ("model.layers.1[0-5].*"). None: every part.
        metrics: Only these metrics (the file's "metrics", e.g. effective_rank). None: every one.
        columns: Only these other columns in wide (index always comes). None: every column
            that is not a module's.
        progress: Show a progress bar while reading (only with modules, metrics or columns).

    Returns:
        (wide, long): wide is the file, one row per input sample (with modules, metrics or columns:
        index, the columns and the chosen modules' metric columns); long has columns index, layer,
        module (the part's role), name (the part's), metric and value, sorted by index, layer,
        module and metric.
    """
    if modules is not None or metrics is not None or columns is not None:
        (rows, long_rows), batches = _scores(path, modules, metrics, columns, progress)
        wides, longs = _Stacked(rows), _Stacked(long_rows)
        for wide, long in batches:
            wides.add(wide)
            longs.add(long)
        return wides.frame(), longs.frame()
    meta = read_metadata(path)
    wide = pq.read_table(path).to_pandas()
    return wide, long_form(wide, meta.get("parts", []), meta.get("metrics", list(METRICS)))


class _Stacked:
    """Frames of the same columns, rows in all, stacked as pd.concat(frames, ignore_index=True) stacks them,
    holding less: pd.concat holds every frame and the whole result at once, twice the result (a million rows'
    long form of 14 columns is 1.1 GB). Here each frame's NumPy columns are copied into the result's arrays as
    it comes (its blocks are freed with it); its other columns (pandas' str, backed by Arrow arrays) are kept
    and joined without a copy. A NumPy column whose dtype changes between frames (an integer column with
    nulls in some) is joined as pd.concat joins it."""

    def __init__(self, rows: int) -> None:
        self._rows, self._at = rows, 0
        self._filled: dict[str, np.ndarray] = {}  # the result's NumPy columns, rows [0, _at) filled
        self._columns: dict[str, list[np.ndarray | pd.Series]] = {}  # the others, frame by frame
        self._order: list[str] = []

    def add(self, frame: pd.DataFrame) -> None:
        n, at = len(frame), self._at
        if not self._order:
            self._order = list(frame.columns)
            for c in self._order:
                if isinstance(frame[c].dtype, np.dtype) and at + n <= self._rows:
                    self._filled[c] = np.empty(self._rows, frame[c].dtype)
                else:
                    self._columns[c] = []
        for c in frame.columns:
            values = frame[c]
            filled = self._filled.get(c)
            if filled is not None and values.dtype == filled.dtype and at + n <= self._rows:
                filled[at:at + n] = values.to_numpy()
                continue
            if filled is not None:  # another dtype: joined from pieces, as pd.concat joins them
                self._columns[c] = [filled[:at]]
                del self._filled[c]
            self._columns[c].append(values.to_numpy(copy=True) if isinstance(values.dtype, np.dtype) else values)
        self._at += n

    def frame(self) -> pd.DataFrame:
        joined = {}
        for c in self._order:
            if c in self._filled:
                filled = self._filled.pop(c)[:self._at]
                joined[c] = pd.Series(filled, dtype=filled.dtype, copy=False)
                continue
            pieces = self._columns.pop(c)
            numpy = all(isinstance(p, np.ndarray) for p in pieces) and len({p.dtype for p in pieces}) == 1
            if numpy:  # its dtype given: an object column of text would be inferred str
                joined[c] = pd.Series(np.concatenate(pieces), dtype=pieces[0].dtype, copy=False)
            else:
                joined[c] = pd.concat([pd.Series(p, dtype=p.dtype, copy=False) for p in pieces], ignore_index=True)
            del pieces
        return pd.DataFrame(joined, copy=False)


LONG_COLUMNS = ["index", "layer", "module", "name", "metric", "value"]
LONG_ROW_BYTES = 100  # about what a row of the long form takes while it is made and sorted


def iter_scores(path: str | Path, *, modules: Iterable[str] | None = None, metrics: Iterable[str] | None = None,
                columns: Iterable[str] | None = None, progress: bool = False,
                ) -> Iterator[tuple[pd.DataFrame, pd.DataFrame]]:
    """read_scores batch by batch, in the file's row order: (wide, long) of each batch of rows, so
    that a file of any size is read in bounded memory. Only the columns asked for are read, and
    the arguments are checked against the file before any row is.

    Args:
        path: A score file, as for read_metadata.
        modules: Only these parts (names, roles or globs of names), as for read_scores.
        metrics: Only these metrics, as for read_scores.
        columns: Only these other columns in wide, as for read_scores. Without modules, metrics
            and columns, wide holds every column.
        progress: Show a progress bar while reading.

    Yields:
        (wide, long) of each batch, as read_scores returns them for the whole file: their
        concatenation is read_scores' (with the same arguments).
    """
    yield from _scores(path, modules, metrics, columns, progress)[1]


def _scores(path: str | Path, modules: Iterable[str] | None, metrics: Iterable[str] | None,
            columns: Iterable[str] | None, progress: bool,
            ) -> tuple[tuple[int, int], Iterator[tuple[pd.DataFrame, pd.DataFrame]]]:
    """((rows of wide, rows of long) in the whole file, iter_scores' batches), the arguments checked first.
    The file's footer is parsed once here, beside read_metadata's check (a million rows' footer is about
    200 MB in memory while it is parsed)."""
    meta = read_metadata(path)
    file = pq.ParquetFile(path)
    parts, chosen, wanted = score_selection(path, meta, modules, metrics, columns, file.schema_arrow.names)
    row_bytes = 8 * len(wanted) + LONG_ROW_BYTES * len(parts) * len(chosen)
    rows = file.metadata.num_rows

    def batches() -> Iterator[tuple[pd.DataFrame, pd.DataFrame]]:
        with file:
            for table in read_batches(file, wanted, progress, f"reading {Path(path).name}", row_bytes):
                wide = table.to_pandas()
                yield wide, long_form(wide, parts, chosen)

    return (rows, rows * len(parts) * len(chosen)), batches()


def score_selection(path: str | Path, meta: dict[str, Any], modules: Iterable[str] | None,
                    metrics: Iterable[str] | None, columns: Iterable[str] | None, names: list[str] | None = None,
                    ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(the parts, the metrics, the file's columns to read) that read_scores' arguments ask for,
    or an error naming what the file does not have. names: the file's columns (None: read here)."""
    names = pq.read_schema(path).names if names is None else names
    parts, known = meta.get("parts", []), meta.get("metrics", list(METRICS))
    if modules is not None:
        patterns = [modules] if isinstance(modules, str) else list(modules)
        unmatched = [m for m in patterns if not any(_is_part(p, m) for p in parts)]
        if unmatched:
            roles = ", ".join(dict.fromkeys(p["role"] for p in parts)) or "none"
            raise OptionError("modules", f"{', '.join(map(repr, unmatched))}: no part of {path} matches (roles: "
                              f"{roles}; or a part's name, or a glob of names)")
        parts = [p for p in parts if any(_is_part(p, m) for m in patterns)]
    chosen = known if metrics is None else [metrics] if isinstance(metrics, str) else list(metrics)
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise OptionError("metrics", f"{', '.join(map(repr, unknown))}: not a metric of {path} ({', '.join(known)})")
    if modules is None and metrics is None and columns is None:
        return parts, chosen, names
    others = [c for c in names if "/" not in c] if columns is None else \
        [columns] if isinstance(columns, str) else list(columns)
    missing = [c for c in others if c not in names]
    if missing:
        raise OptionError("columns", f"{', '.join(map(repr, missing))}: not a column of {path}")
    wanted = {"index", *others, *(column(p["name"], m) for p in parts for m in chosen)}
    return parts, chosen, [c for c in names if c in wanted]


def _is_part(part: dict[str, Any], pattern: str) -> bool:
    return pattern in (part["name"], part["role"]) or fnmatch.fnmatchcase(part["name"], pattern)


def long_form(wide: pd.DataFrame, parts: list[dict[str, Any]], metrics: list[str]) -> pd.DataFrame:
    """The long form (read_scores) of these parts' metrics in wide: a row per (index, part, metric)."""
    frames = []
    for p in parts:
        cols = [column(p["name"], m) for m in metrics]
        block = wide[["index", *cols]].melt(id_vars="index", var_name="metric", value_name="value")
        # the metric of each column's rows, sharing a str each (8 bytes a row)
        block["metric"] = pd.Series(np.repeat(np.array(metrics, dtype=object), len(wide)), dtype=object)
        block["name"], block["layer"], block["module"] = p["name"], p["layer"], p["role"]
        frames.append(block)
    long = pd.concat(frames, ignore_index=True)[LONG_COLUMNS] if frames else pd.DataFrame(columns=LONG_COLUMNS)
    return long.sort_values(["index", "layer", "module", "metric"], ignore_index=True)


def read_batches(source: str | Path | pq.ParquetFile, columns: list[str] | None, progress: bool = False,
                 desc: str = "reading", row_bytes: int | None = None) -> Iterator[pa.Table]:
    """The rows of a Parquet file in order, of these columns only (None: all), about BATCH_BYTES at a
    time (row_bytes: what a row takes in memory as the caller holds it; default 8 a column), at least one
    table (empty for a file without rows). Row groups smaller than a batch are read together (a run's
    parts, in files merged by old versions), up to twice a batch whole, larger ones in slices (pyarrow
    holds a row group read in slices about twice over, and its iter_batches over many row groups keeps
    every one it read until the end: each is sliced alone)."""
    file = source if isinstance(source, pq.ParquetFile) else pq.ParquetFile(source)
    columns = list(dict.fromkeys(file.schema_arrow.names if columns is None else columns))
    rows = max(1, min(1 << 20, BATCH_BYTES // (row_bytes or 8 * max(1, len(columns)))))
    meta = file.metadata
    if meta.num_rows == 0:
        yield file.schema_arrow.empty_table().select(columns)
        return
    with tqdm(total=meta.num_rows, desc=desc, unit="row", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        group: list[int] = []
        held = 0
        for i in range(meta.num_row_groups):
            n = meta.row_group(i).num_rows
            if group and held + n > rows:
                yield file.read_row_groups(group, columns=columns)
                bar.update(held)
                group, held = [], 0
            if n <= 2 * rows:
                group.append(i)
                held += n
                continue
            for batch in file.iter_batches(batch_size=rows, row_groups=[i], columns=columns):
                yield pa.Table.from_batches([batch])
                bar.update(batch.num_rows)
        if group:
            yield file.read_row_groups(group, columns=columns)
            bar.update(held)
