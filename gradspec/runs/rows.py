"""A scoring run's output rows: one per sample, made from the tokenizer's status, filled with a
batch's scores (and the classic ones), and completed so that every row has every column."""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from typing import Any

import torch

from gradspec.data.batching import Item
from gradspec.data.readers import Sample
from gradspec.engine.spectral_engine import BatchScores, SpectralEngine
from gradspec.runs.classic_scores import CLASSIC_COLUMNS, loss_ratios, losses_alone, response_text
from gradspec.runs.run_folder import INPUT_ERROR
from gradspec.runs.score_files import (
    ATTRIBUTION,
    PROJECTION,
    ROUTED_TOKENS,
    SPECTRA,
    carried_name,
    column,
    metric_columns,
)

log = logging.getLogger("gradspec")


def unscored_row(item: Item) -> dict[str, Any]:
    """An output row before scoring: the tokenizer's status, no loss yet."""
    row = {
        "index": item.sample.index,
        "status": item.tokens.status,
        "loss": math.nan,
        "num_tokens": item.tokens.num_tokens,
        "num_response_tokens": item.tokens.num_response_tokens,
    }
    row.update({carried_name(k): v for k, v in item.sample.carried.items()})
    return row


def skipped_row(sample: Sample) -> dict[str, Any]:
    """A row skipped for bad input (on_error="skip"): why, and nothing scored."""
    log.warning("skipped: %s", sample.error)
    return {"index": sample.index, "status": INPUT_ERROR, "error": sample.error, "loss": math.nan,
            "num_tokens": 0, "num_response_tokens": 0}


def add_classic(engine: SpectralEngine, tokenizer, items: list[Item], rows: dict[int, dict[str, Any]],
                max_length: int, batch_tokens: int) -> None:
    """IFD and friends for the scored rows: one extra no-grad pass over the responses alone."""
    alone = losses_alone(engine.model, tokenizer, [i.sample for i in items], max_length, batch_tokens)
    for item in items:
        row = rows[item.sample.index]
        row["response_chars"] = len(response_text(item.sample))
        if math.isfinite(row["loss"]):
            row.update(loss_ratios(row["loss"], alone[item.sample.index]))
            if not math.isfinite(row["ifd"]):
                row["status"] = "ifd_undefined" if row["status"] == "ok" else row["status"] + ";ifd_undefined"


def collect(pending: list[tuple[Item, Future[BatchScores] | None, int]], rows: dict[int, dict[str, Any]],
            names: tuple[str, ...]) -> int:
    """Waits for submitted batches and fills their rows; returns the tokens they held. A batch whose
    eigen stage ran out of memory (past its own retries on the host) has its rows flagged out_of_memory."""
    for item, future, k in pending:
        try:
            result = None if future is None else future.result()
        except torch.OutOfMemoryError as error:
            log.warning("sample %d: its batch ran out of memory after its pass (%s); flagged out_of_memory",
                        item.sample.index, str(error)[:200])
            result = None
        fill_scores(rows[item.sample.index], result, k, names)
    return sum(item.tokens.num_tokens for item, _, _ in pending)


def fill_scores(row: dict[str, Any], result: BatchScores | None, k: int, names: tuple[str, ...]) -> None:
    """Row k of a batch's scores into its output row (None: the sample did not fit in memory)."""
    if result is None:  # its tokenizer's flags (truncated, ...) kept beside it
        row["status"] = ";".join([f for f in row["status"].split(";") if f not in ("ok", "")] + ["out_of_memory"])
        return
    flags = [f for f in (row["status"], result.status(k)) if f != "ok"]
    row["status"], row["loss"] = ";".join(flags) or "ok", float(result.loss[k])
    row.update(metric_columns(result.metrics, k, names))
    row.update({column(name, ROUTED_TOKENS): int(counts[k]) for name, counts in result.routed_tokens.items()})
    for name, sigmas in result.spectra.items():
        row[column(name, SPECTRA)] = sigmas[k].tolist()
    row.update({name: float(values[k]) for name, values in result.token_stats.items()})
    row.update({name: float(values[k]) for name, values in result.alignment.items()})
    if result.attribution is not None:
        row[ATTRIBUTION] = result.attribution[k].tolist()
    if result.projection is not None and bool(torch.isfinite(result.projection[k]).all()):
        row[PROJECTION] = result.projection[k].numpy()


def with_every_column(row: dict[str, Any], engine: SpectralEngine) -> dict[str, Any]:
    """Unscored rows get NaN metrics (their status says why), so every row has every column."""
    if engine.token_stats:
        for name in CLASSIC_COLUMNS:
            row.setdefault(name, math.nan)
    if engine.task is not None:
        for name in engine.task.metric_names:
            row.setdefault(name, math.nan)
        if engine.task.attribution:
            row.setdefault(ATTRIBUTION, None)
    if engine.projection is not None:
        row.setdefault(PROJECTION, None)
    for name in engine.part_names:
        for m in engine.metric_names:
            row.setdefault(column(name, m), math.nan)
        if engine.keep_spectra:
            row.setdefault(column(name, SPECTRA), [])
    for name in engine.routed_names:
        row.setdefault(column(name, ROUTED_TOKENS), None)
    return row
