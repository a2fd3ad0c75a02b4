"""Score files: Parquet, one row per input sample in input order, written a row group at a time."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .metrics import METRICS
from .modules import Part, layer_index

BASE_COLUMNS = ("index", "status", "loss", "num_tokens", "num_response_tokens")
SPECTRA = "singular_values"
_METADATA_KEY = b"gradspec"


def column(part: str, metric: str) -> str:
    return f"{part}/{metric}"


def carried_name(name: str) -> str:
    """Input columns keep their name unless it would clash with ours."""
    return f"input_{name}" if name in BASE_COLUMNS or "/" in name else name


class ScoreWriter:
    """Appends rows to a Parquet file; the schema is fixed by the first rows written."""

    def __init__(
        self, path: str | Path, parts: list[Part], metrics: tuple[str, ...], save_spectra: bool,
        run_info: dict[str, Any],
    ) -> None:
        self.path = Path(path)
        self.parts = parts
        self.save_spectra = save_spectra
        self.metadata = {
            "parts": [{"name": p.name, "role": p.role, "layer": layer_index(p.name), "d_in": p.d_in,
                       "d_out": p.d_out} for p in parts],
            "metrics": list(metrics),
            **run_info,
        }
        self.schema: pa.Schema | None = None
        self.writer: pq.ParquetWriter | None = None

    def _schema(self, table: pa.Table) -> pa.Schema:
        fields = []
        for f in table.schema:
            if pa.types.is_null(f.type):
                f = f.with_type(pa.string())  # a column empty in the first rows: assume text
            fields.append(f)
        meta = {_METADATA_KEY: json.dumps(self.metadata).encode()}
        return pa.schema(fields, metadata=meta)

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if self.schema is None:
            keys = dict.fromkeys(k for row in rows for k in row)  # all rows' columns, not the first's
            self.schema = self._schema(pa.table({k: [row.get(k) for row in rows] for k in keys}))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = pq.ParquetWriter(self.path, self.schema)
        new = sorted({k for row in rows for k in row} - set(self.schema.names))
        if new:
            warnings.warn(f"rows from index {rows[0]['index']}: input columns {new} were absent from the "
                          "first rows and are not carried", stacklevel=2)
        try:
            table = pa.Table.from_pylist(rows, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
            first = rows[0]["index"]
            raise ValueError(
                f"rows from index {first}: a carried input column changed type from the first rows "
                f"({e}); schema: {self.schema.remove_metadata()}"
            ) from None
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> ScoreWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metadata(path: str | Path) -> dict[str, Any]:
    """What a score file says of its run: model, data, template, modules, parts, metrics, ..."""
    return json.loads((pq.read_schema(path).metadata or {}).get(_METADATA_KEY, b"{}"))


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
