"""Aligning a stored pool with a task: the pool's projected gradients are read from a store (a
score file with a projected_gradient column, from `gradspec project`), only the task's go through
the model. Streamed in row batches, so a store need not fit in memory."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gradspec.alignment.cosines import projected_cosines
from gradspec.alignment.projection import ProjectionCapture
from gradspec.alignment.task import alignment_metrics
from gradspec.choices import DEFAULT_AGGREGATES, MAX_LENGTH, check_aggregates
from gradspec.data.batching import batch_tokens_for
from gradspec.data.models import fit_to_context, load_model
from gradspec.data.readers import Fields
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.files import atomic_write, regular
from gradspec.layers.hooks import BatchLayout
from gradspec.options import OptionExists, mention
from gradspec.runs.config import ScoreConfig
from gradspec.runs.score_files import METADATA_KEY, PROJECTION, column, read_metadata
from gradspec.runs.task_set import task_batches

READ_ROWS = 4096  # store rows per streamed batch


def store_engine(meta: dict[str, Any], store: str | Path, device: str, trust_remote_code: bool):
    """(engine, tokenizer): the model and projection the store was written with (its metadata says which)."""
    projection = meta.get("projection")
    if not projection:
        raise ValueError(f"{store} holds no projected gradients; write a store with `gradspec project`")
    model, tokenizer = load_model(ScoreConfig.from_manifest(meta).model, device, meta.get("dtype", "float32"),
                                  trust_remote_code)  # the recorded name read back as a run reads it (the default)
    engine = SpectralEngine(model, meta["modules"], spectra=False, project=projection["k_in"],
                            seed=projection["seed"], precision=meta.get("precision", "fp64"))
    if engine.projection.describe() != projection:
        raise ValueError(f"{store}: the model's scored parts differ from the store's ({meta['model']}, modules "
                         f"{meta['modules']}); was the model changed since?")
    return engine, tokenizer


def task_vectors(engine: SpectralEngine, batches: list) -> torch.Tensor:
    """(m, dims): the projected gradient of each task example that has a usable one (a loss, a
    finite nonzero projection), as the store's were made."""
    vectors = []
    for batch in batches:
        capture = ProjectionCapture(engine.targets, BatchLayout(batch[1].sum(1).cpu(), batch[0].device),
                                    engine.projection, engine.policy.dtype)
        _, _, finite, _ = engine.backward_pass([capture], batch)
        v = capture.vectors()
        capture.release()
        vectors.append(v[finite & torch.isfinite(v).all(1) & (v.abs().sum(1) > 0)])
    found = torch.cat(vectors)
    if not len(found):
        raise ValueError("no task example has a usable projected gradient (response tokens, a finite nonzero "
                         "gradient): check the task file and the template")
    return found


def query_store(
    store: str | Path, task: str | Path, out: str | Path, aggregate: str | list[str] = DEFAULT_AGGREGATES, *,
    device: str = "cpu", batch_tokens: int | None = None, overwrite: bool = False, trust_remote_code: bool = False,
    top: int | None = None,
) -> Counter[str]:
    """Writes out: the store's rows (index, status, loss, lengths, carried columns) with the projected
    cosines per part and over the model; returns the count of each status. top: only the top rows by
    ranked_by(aggregates), found through the store's index (gradspec.runs.store_index) and their values
    computed exactly, as the whole scan computes them; the file's metadata says how (top)."""
    aggregates = check_aggregates(aggregate)
    if Path(out).exists() and not overwrite:
        raise OptionExists((), f"{out} exists; pass {mention('overwrite')} or choose another {mention('out')}")
    meta = read_metadata(store)
    if top is not None:
        from gradspec.runs.store_index import read_index

        if top < 1:
            raise OptionExists((), f"{mention('top')} {top}: give a number of rows of 1 or more")
        index = read_index(store)  # refused before the model loads
    engine, tokenizer = store_engine(meta, store, device, trust_remote_code)
    fields = Fields(**meta.get("fields", {}))
    batches = task_batches(task, tokenizer, fields, meta.get("template", "plain"),
                           fit_to_context(meta.get("max_length", MAX_LENGTH), engine.model),
                           batch_tokens or batch_tokens_for(device), next(engine.model.parameters()).device)
    task_values = task_vectors(engine, batches)
    names = [p.name for p in engine.projection.parts]
    routed = {p.name for p in engine.projection.parts if p.routed}
    metrics = alignment_metrics(aggregates)
    # pre-buffered (pyarrow's default), every row group read stays allocated until the reader closes: the whole store
    reader = pq.ParquetFile(regular(store), pre_buffer=False, buffer_size=1 << 20)
    kept = kept_columns(reader)
    statuses: Counter[str] = Counter()
    info = {**meta, "metrics": list(metrics), "task": str(Path(task).resolve()), "aggregate": ",".join(aggregates),
            "store": str(Path(store).resolve()), "task_examples": {"kept": len(task_values)},
            "estimate": f"cosines of Kronecker-projected gradients (k_in = k_out = {meta['projection']['k_in']})"}
    schema = None
    if top is not None:
        try:
            table, info["top"] = top_rows(index, reader, kept, names, task_values, aggregates, routed, top)
        finally:
            index.close()  # its vectors file, held open since it was checked
        tables = iter([table])
    else:
        tables = scanned(reader, kept, names, task_values, aggregates, routed)

    def write(f) -> None:
        nonlocal schema
        writer = None
        for table in tables:
            statuses.update(table["status"].to_pylist())
            if writer is None:
                schema = table.schema.with_metadata({METADATA_KEY: json.dumps(info).encode()})
                writer = pq.ParquetWriter(f, schema)
            writer.write_table(table.cast(schema))
        if writer is not None:
            writer.close()

    atomic_write(out, write)
    return statuses


def kept_columns(reader: pq.ParquetFile) -> list[str]:
    """The store's columns an alignment file carries (all but the vectors and any earlier alignment)."""
    return [f.name for f in reader.schema_arrow if f.name != PROJECTION and "/" not in f.name
            and not f.name.startswith("align_")]


def scanned(reader: pq.ParquetFile, kept: list[str], names: list[str], task_values: torch.Tensor,
            aggregates: tuple[str, ...], routed: set[str]) -> Iterator[pa.Table]:
    """The exact scan: every row of the store with its cosines, a batch at a time."""
    metrics = alignment_metrics(aggregates)
    for batch in reader.iter_batches(batch_size=READ_ROWS):
        yield _aligned(batch, kept, names, metrics, task_values, aggregates, routed)


def ranked_by(aggregates: tuple[str, ...]) -> str:
    """The whole-model column --top ranks by: align_mean, else align_mean_gradient, else align_max (the
    one select --by alignment reads, where there is one)."""
    return f"align_{next(a for a in ('mean', 'mean_gradient', 'max') if a in aggregates)}"


def index_queries(task_values: torch.Tensor, by: str) -> np.ndarray:
    """The vectors whose nearest rows by cosine hold the top rows by this column: the task's mean gradient
    (align_mean_gradient); the mean of its unit vectors (align_mean: mean_j cos(x, v_j) = cos(x, q) |q|);
    each of its vectors (align_max: a row of the top K by the max is in the top K of the example where
    its max is reached, so the union of the per-example tops holds the top K)."""
    v = task_values.double()
    if by == "align_mean_gradient":
        return v.mean(0, keepdim=True).numpy()
    if by == "align_mean":
        return (v / v.norm(dim=1, keepdim=True)).mean(0, keepdim=True).numpy()
    return v.numpy()


def top_rows(index, reader: pq.ParquetFile, kept: list[str], names: list[str], task_values: torch.Tensor,
             aggregates: tuple[str, ...], routed: set[str], top: int) -> tuple[pa.Table, dict[str, Any]]:
    """(the top rows by ranked_by, highest first, with the columns the exact scan gives them and the same
    values; what the file's metadata says of the search). The index gives candidates (its top
    CANDIDATES x top rows per query vector); from the store's own vectors, their whole-model column is
    computed as the scan computes it (projected_cosines, row by row), the top kept, and only those rows' parts."""
    from gradspec.runs.store_index import index_path

    by = ranked_by(aggregates)
    ids = index.candidates(index_queries(task_values, by), top)  # sorted; never none (an index has rows)
    vectors = index.rows(ids)
    whole = projected_cosines(torch.from_numpy(vectors.astype(np.float64)), task_values, ["model"], aggregates)[1]
    values = whole[:, aggregates.index(by[len("align_"):])].numpy()
    finite = np.flatnonzero(~np.isnan(values))
    order = finite[np.argsort(-values[finite], kind="stable")][:top]
    columns = _rows_of(reader, kept, ids[order])
    flat = pa.array(vectors[order].ravel(), pa.float32())
    columns = columns.append_column(PROJECTION, pa.FixedSizeListArray.from_arrays(flat, index.header["dims"]))
    batch = pa.RecordBatch.from_arrays([c.combine_chunks() for c in columns.columns], schema=columns.schema)
    table = _aligned(batch, kept, names, alignment_metrics(aggregates), task_values, aggregates, routed)
    info = {"rows": top, "by": by, "candidates": int(len(ids)), "index": str(index_path(index.store).resolve()),
            "settings": index.header["settings"], "recall": index.header["recall"], "described": index.describe()}
    return table, info


def _rows_of(reader: pq.ParquetFile, kept: list[str], rows: np.ndarray) -> pa.Table:
    """These rows' kept columns, in this order, reading only the row groups that hold them."""
    starts = np.cumsum([0] + [reader.metadata.row_group(g).num_rows for g in range(reader.num_row_groups)])
    groups = np.searchsorted(starts, rows, side="right") - 1
    parts, where = [], np.empty(len(rows), np.int64)
    for g in np.unique(groups):
        pick = np.flatnonzero(groups == g)
        parts.append(reader.read_row_group(int(g), columns=kept).take(pa.array(rows[pick] - starts[g])))
        where[pick] = np.arange(len(pick)) + sum(len(p) for p in parts[:-1])
    if not parts:
        return reader.schema_arrow.empty_table().select(kept)
    return pa.concat_tables(parts).take(pa.array(where))


def _aligned(batch: pa.RecordBatch, kept: list[str], names: list[str], metrics: tuple[str, ...],
             task_values: torch.Tensor, aggregates: tuple[str, ...], routed: set[str]) -> pa.Table:
    """The batch's rows with their cosines; a NaN one flags the row alignment_undefined, except in a routed
    part (an expert the sample or the task did not reach), as the exact alignment flags (flag_alignment)."""
    values = batch.column(PROJECTION)
    present = ~np.asarray(values.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    dims = task_values.shape[1]
    pool = torch.full((len(batch), dims), math.nan, dtype=torch.float64)
    if present.any():
        flat = values.filter(pa.array(present)).flatten().to_numpy(zero_copy_only=False)
        pool[torch.from_numpy(present)] = torch.from_numpy(np.asarray(flat, dtype=np.float64).reshape(-1, dims))
    per_part, model = projected_cosines(pool, task_values, names, aggregates)
    columns = {name: batch.column(name) for name in kept}
    undefined = torch.from_numpy(present) & torch.isnan(model).any(1)
    for name, v in per_part.items():
        if name not in routed:
            undefined |= torch.from_numpy(present) & torch.isnan(v).any(1)
    columns["status"] = pa.array([("alignment_undefined" if s == "ok" else f"{s};alignment_undefined") if u else s
                                  for s, u in zip(batch.column("status").to_pylist(), undefined.tolist(), strict=True)])
    for k, metric in enumerate(metrics):
        columns[metric] = pa.array(model[:, k].numpy())
    for name, v in per_part.items():
        for k, metric in enumerate(metrics):
            columns[column(name, metric)] = pa.array(v[:, k].numpy())
    return pa.table(columns)

