"""Score files: Parquet, one row per input sample in input order, with the run described in its metadata."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gradspec.data.errors import InputError
from gradspec.data.templates import SCORED
from gradspec.layers.targets import Part, layer_index
from gradspec.linalg.metrics import METRICS, metrics_dict

BASE_COLUMNS = ("index", "status", "error", "loss", "num_tokens", "num_response_tokens")
SPECTRA = "singular_values"
ROUTED_TOKENS = "routed_tokens"  # per expert, "<experts module>.<e>/routed_tokens": the sample's tokens sent there
ATTRIBUTION = "attribution"  # align --attribution's column: per task file row, the inner product with its gradient
PROJECTION = "projected_gradient"  # a store's column: gradspec.alignment.projection's values, fp32
METADATA_KEY = b"gradspec"


def complete(status: pd.Series) -> pd.Series:
    """Rows whose every metric was computed: no flag but the tokenizer's flags of scored rows
    (templates.SCORED), no numeric one. They compete in a selection and enter a report."""
    return status.str.split(";").map(lambda flags: set(flags) <= set(SCORED))


def column(part: str, metric: str) -> str:
    return f"{part}/{metric}"


def metric_columns(metrics: dict[str, torch.Tensor], i: int, names: tuple[str, ...]) -> dict[str, float]:
    """Row i of per-module metric tables as output columns: {"<module>/<metric>": value}."""
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
    modules = [{"name": p.name, "role": p.role, "layer": layer_index(p.name), "d_in": p.d_in, "d_out": p.d_out}
               for p in parts]
    return {"parts": modules, "metrics": list(metrics), **run_info}


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """write(file) into a temporary file beside path, flushed to disk, then renamed onto path: the
    file at path is either the old one or the whole new one, never part of it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk says only "[Errno 28] No space left on device": name the file
        tmp.unlink(missing_ok=True)
        if e.filename is not None:
            raise
        if e.errno:
            raise OSError(e.errno, f"{os.strerror(e.errno)} (writing it)", str(path)) from e
        raise OSError(f"{path}: {' '.join(str(e).split())} (writing it)") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_parquet(table: pa.Table | pd.DataFrame, path: str | Path, metadata: dict[str, Any] | None = None) -> None:
    """A table, or a DataFrame without its index, written to path atomically (atomic_write); with
    metadata, that as JSON under METADATA_KEY beside the schema's own (pandas') metadata."""
    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    if metadata is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               METADATA_KEY: json.dumps(metadata).encode()})
    atomic_write(path, lambda f: pq.write_table(table, f))


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
    try:
        return pq.read_schema(path)
    except pa.ArrowInvalid:
        raise InputError(f"{path}: not a Parquet file; {what}") from None


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


def read_scores(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(wide, long): the file as a DataFrame, and one row per (sample, layer, module, metric).

    Args:
        path: A score file, as for read_metadata.

    Returns:
        (wide, long): wide is the file, one row per input sample; long has columns index, layer,
        module (the part's role), name (the part's), metric and value, sorted by index, layer,
        module and metric.
    """
    meta = read_metadata(path)
    wide = pq.read_table(path).to_pandas()
    parts = meta.get("parts", [])
    metrics = meta.get("metrics", list(METRICS))
    frames = []
    for p in parts:
        cols = [column(p["name"], m) for m in metrics]
        block = wide[["index", *cols]].melt(id_vars="index", var_name="metric", value_name="value")
        block["metric"] = block["metric"].str.rsplit("/", n=1).str[1]
        block["name"], block["layer"], block["module"] = p["name"], p["layer"], p["role"]
        frames.append(block)
    columns = ["index", "layer", "module", "name", "metric", "value"]
    long = pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)
    return wide, long.sort_values(["index", "layer", "module", "metric"], ignore_index=True)
