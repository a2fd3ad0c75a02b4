"""A monitored step's micro-batches as rows: one per sample, typed for its Parquet part, and their summary.

Columns: step, micro_batch, row, sample_index (the dataset index, where the loop gives it: an
``index_column`` in the batch, popped before the model sees it, or ``indices``), loss, loss_kind,
num_tokens, num_response_tokens (null without labels in the model call), num_loss_tokens (n_i;
null where not scaled), scaled, status (``no_loss_tokens`` where n_i = 0: no metrics), then every
module's metrics (gradspec.training.monitor_loss says which loss a row is the gradient of).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from gradspec.layers.registry import Target
from gradspec.linalg.metrics import metric_names
from gradspec.runs.score_files import column, metric_columns
from gradspec.training.monitor_batch import MicroBatch

COLUMN_TYPES = {  # the rest are metrics, float64
    "step": pa.int64(), "micro_batch": pa.int64(), "row": pa.int64(), "sample_index": pa.int64(), "loss": pa.float64(),
    "loss_kind": pa.string(), "num_tokens": pa.int64(), "num_response_tokens": pa.int64(),
    "num_loss_tokens": pa.int64(), "scaled": pa.bool_(), "status": pa.string(),
}


def step_rows(step: int, micro_batches: list[MicroBatch]) -> list[dict[str, Any]]:
    """The step's rows, each micro-batch's eigen stage run where it has not yet."""
    rows, names = [], metric_names()
    for micro_batch, micro in enumerate(micro_batches):
        micro.reduce()
        (metrics, flags), capture, tokens = micro.reduced[0], micro.capture, micro.tokens.cpu()
        losses = micro.losses[0].cpu().tolist() if micro.losses else [None] * len(tokens)
        for i in range(len(tokens)):
            loss = losses[i] if tokens[i] > 0 else None
            if loss is not None and not math.isfinite(loss):
                flags[i].add("nonfinite_loss")
            row = {"step": step, "micro_batch": micro_batch, "row": i,
                   "sample_index": micro.indices[i], "loss": loss, "loss_kind": micro.loss_kind,
                   "num_tokens": int(capture.lengths[i]),
                   "num_response_tokens": None if micro.responses is None else int(micro.responses[i]),
                   "num_loss_tokens": int(tokens[i]) if micro.scaled else None,
                   "scaled": micro.scaled, "status": ";".join(sorted(flags[i])) or "ok"}
            rows.append({**row, **metric_columns(metrics, i, names)})
    return rows


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as a table of the monitor's column types (a column typed even where all its values are null)."""
    schema = pa.schema([(name, COLUMN_TYPES.get(name, pa.float64())) for name in rows[0]])
    return pa.Table.from_pylist(rows, schema=schema)


def summary(rows: list[dict[str, Any]], targets: Iterable[Target]) -> dict[str, float]:
    """Mean over samples and layers of nuclear norm and effective rank, per module role."""
    out: dict[str, list[float]] = {}
    for t in targets:
        for part in t.parts:
            for metric in ("nuclear_norm", "effective_rank"):
                values = [r[column(part.name, metric)] for r in rows]
                out.setdefault(f"spectra/{part.role}/{metric}", []).extend(v for v in values if math.isfinite(v))
    return {k: sum(v) / len(v) for k, v in out.items() if v}
