"""LESS's sum over checkpoints: align files of one pool and target, each under another training
checkpoint's model and AdamW state (align --precondition adam), summed with weights (by default each
checkpoint's learning rate, as its file recorded it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from gradspec.data.errors import InputError
from gradspec.runs.score_files import ATTRIBUTION, read_metadata, write_parquet


def sum_over_checkpoints(files: list[str | Path], out: str | Path,
                         weights: list[float] | None = None) -> pd.DataFrame:
    """Σ_c w_c x (every align_* column and the attribution) over the files, one row per pool row.

    Args:
        files: Align files of the same pool and target (one per checkpoint).
        out: The Parquet file written (atomically), its metadata naming the files and weights.
        weights: One per file; default: the learning rate each file's Adam preconditioner recorded.

    Returns:
        The summed table: index, status ("ok" where every file scored the row, else the first
        problem found), the summed columns.
    """
    if not files:
        raise ValueError("no align files to sum")
    metas = [read_metadata(f) for f in files]
    if weights is None:
        weights = []
        for f, meta in zip(files, metas, strict=True):
            lr = (meta.get("preconditioner") or {}).get("lr")
            if lr is None:
                raise InputError(f"{f}: no learning rate recorded (not an align --precondition adam file); give "
                                 "the weights")
            weights.append(float(lr))
    if len(weights) != len(files):
        raise ValueError(f"{len(weights)} weights for {len(files)} files")
    for f, meta in zip(files[1:], metas[1:], strict=True):
        for key in ("data", "task"):
            if meta.get(key) != metas[0].get(key):
                raise InputError(f"{f}: {key} {meta.get(key)!r}, but {files[0]} has {metas[0].get(key)!r}: "
                                 "not the same pool and target")
    frames = [pd.read_parquet(f).set_index("index").sort_index() for f in files]
    columns = [c for c in frames[0].columns if c.split("/")[-1].startswith("align_")]
    summed = pd.DataFrame(index=frames[0].index)
    for f, frame in zip(files[1:], frames[1:], strict=True):
        if not frame.index.equals(frames[0].index) or [c for c in columns if c not in frame.columns]:
            raise InputError(f"{f}: other rows or columns than {files[0]}")
    status = frames[0]["status"].copy()
    for frame in frames[1:]:
        status = status.where(status != "ok", frame["status"])
    summed["status"] = status
    for c in columns:
        summed[c] = sum(w * frame[c].to_numpy() for w, frame in zip(weights, frames, strict=True))
    if ATTRIBUTION in frames[0].columns:
        width = metas[0]["task_examples"]["rows"]

        def stacked(frame):  # an unscored row's None as NaN
            return np.stack([np.full(width, np.nan) if v is None else np.asarray(v, dtype=float)
                             for v in frame[ATTRIBUTION]])
        total = sum(w * stacked(frame) for w, frame in zip(weights, frames, strict=True))
        summed[ATTRIBUTION] = list(total)
    summed = summed.reset_index()
    write_parquet(summed, out, {**metas[0], "preconditioner": {"preconditioner": "adam", "summed_over": [
        {"file": str(Path(f).resolve()), "weight": w, **(m.get("preconditioner") or {})}
        for f, w, m in zip(files, weights, metas, strict=True)]}, "weights": list(weights)})
    return summed
