"""Score files: Parquet, one row per input sample in input order, with the run described in its metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import torch

from gradspec.data.templates import SCORED
from gradspec.layers.targets import Part, layer_index
from gradspec.linalg.metrics import METRICS, metrics_dict

BASE_COLUMNS = ("index", "status", "error", "loss", "num_tokens", "num_response_tokens")
SPECTRA = "singular_values"
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


def carried_name(name: str) -> str:
    """Input columns keep their name unless it would clash with ours."""
    return f"input_{name}" if name in BASE_COLUMNS or "/" in name else name


def file_metadata(parts: list[Part], metrics: tuple[str, ...], run_info: dict[str, Any]) -> dict[str, Any]:
    """What a score file says of its run, under METADATA_KEY in the Parquet schema."""
    modules = [{"name": p.name, "role": p.role, "layer": layer_index(p.name), "d_in": p.d_in, "d_out": p.d_out}
               for p in parts]
    return {"parts": modules, "metrics": list(metrics), **run_info}


def read_metadata(path: str | Path) -> dict[str, Any]:
    """What a score file says of its run: model, data, template, modules, parts, metrics, ..."""
    return json.loads((pq.read_schema(path).metadata or {}).get(METADATA_KEY, b"{}"))


def read_scores(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(wide, long): the file as a DataFrame, and one row per (sample, layer, module, metric)."""
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
