"""Scoring a dataset: read in order, bucket by length, batch under a token budget, write in order."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from concurrent.futures import Future
from itertools import islice
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm

from .batching import BATCH_TOKENS, Item, pad_batch, token_batches
from .classic import CLASSIC_COLUMNS, loss_ratios, losses_alone, response_text
from .data import HUMANEVAL_SIZE, Fields, Sample, count_records, humaneval_samples, read_samples
from .engine import BatchScores, SpectralEngine
from .metrics import metrics_dict
from .models import DEFAULT_MODEL, load_model
from .output import SPECTRA, ScoreWriter, carried_name, column, read_scores
from .templates import tokenize

log = logging.getLogger("gradspec")

WINDOW = 256  # samples read, length-sorted and written together


def submit_with_split(
    engine: SpectralEngine, batch: list[Item], pad_id: int, device: torch.device
) -> list[tuple[Item, Future[BatchScores] | None, int]]:
    """(item, future scores, row in them) for each item. Out of memory: split the batch in half
    and retry each half; a single sample that still does not fit gets None (flagged by the caller)."""
    try:
        result = engine.submit(*pad_batch([b.tokens for b in batch], pad_id, device))
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(batch) == 1:
            log.warning("sample %d does not fit in memory (%d tokens); flagged out_of_memory",
                        batch[0].sample.index, batch[0].tokens.num_tokens)
            return [(batch[0], None, 0)]
        log.warning("out of memory on a batch of %d; retrying it in two halves", len(batch))
        half = len(batch) // 2
        return (submit_with_split(engine, batch[:half], pad_id, device)
                + submit_with_split(engine, batch[half:], pad_id, device))
    return [(item, result, k) for k, item in enumerate(batch)]


def _row(item: Item) -> dict[str, Any]:
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


def score_samples(
    samples: Iterable[Sample], engine: SpectralEngine, tokenizer, writer: ScoreWriter | None,
    template: str = "plain", max_length: int = 2048, batch_tokens: int = BATCH_TOKENS, progress: bool = True,
    total: int | None = None,
) -> list[dict[str, Any]]:
    """Scores samples window by window; rows go to the writer (or are returned when it is None)."""
    device = next(engine.model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    kept: list[dict[str, Any]] = []
    stream = iter(samples)
    bar = tqdm(total=total, unit="sample", disable=not progress, dynamic_ncols=True)
    start, tokens = time.perf_counter(), 0
    try:
        while window := list(islice(stream, WINDOW)):
            items = [Item(s, tokenize(s.messages, tokenizer, template, max_length)) for s in window]
            rows = {item.sample.index: _row(item) for item in items}
            # One batch in flight: its eigen stage runs while the next batch's forward and backward do.
            pending: list[tuple[Item, Future[BatchScores] | None, int]] = []
            for batch in token_batches([i for i in items if i.tokens.status == "ok"], batch_tokens):
                submitted = submit_with_split(engine, batch, pad_id, device)
                tokens += _collect(pending, rows, engine.metric_names)
                pending = submitted
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}", refresh=False)
            tokens += _collect(pending, rows, engine.metric_names)
            if engine.token_stats:
                _add_classic(engine, tokenizer, [i for i in items if i.tokens.status == "ok"], rows,
                             max_length, batch_tokens)
            bar.update(len(window) - sum(1 for i in items if i.tokens.status == "ok"))
            ordered = [_fill(rows[s.index], engine) for s in window]
            if writer is None:
                kept.extend(ordered)
            else:
                writer.write(ordered)
    finally:
        bar.close()
    return kept


def _add_classic(engine: SpectralEngine, tokenizer, items: list[Item], rows: dict[int, dict[str, Any]],
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


def _collect(pending: list[tuple[Item, Future[BatchScores] | None, int]], rows: dict[int, dict[str, Any]],
             names: tuple[str, ...]) -> int:
    """Waits for submitted batches and fills their rows; returns the tokens they held."""
    for item, future, k in pending:
        _fill_scores(rows[item.sample.index], None if future is None else future.result(), k, names)
    return sum(item.tokens.num_tokens for item, _, _ in pending)


def _fill_scores(row: dict[str, Any], result: BatchScores | None, k: int, names: tuple[str, ...]) -> None:
    """Row k of a batch's scores into its output row (None: the sample did not fit in memory)."""
    if result is None:
        row["status"] = "out_of_memory"
        return
    row["status"], row["loss"] = result.status(k), float(result.loss[k])
    for name, values in result.metrics.items():
        row.update({column(name, m): v for m, v in metrics_dict(values[k], names).items()})
    for name, sigmas in result.spectra.items():
        row[column(name, SPECTRA)] = sigmas[k].tolist()
    row.update({name: float(values[k]) for name, values in result.token_stats.items()})


def _fill(row: dict[str, Any], engine: SpectralEngine) -> dict[str, Any]:
    """Unscored rows get NaN metrics (their status says why), so every row has every column."""
    if engine.token_stats:
        for name in CLASSIC_COLUMNS:
            row.setdefault(name, math.nan)
    for name in engine.part_names:
        for m in engine.metric_names:
            row.setdefault(column(name, m), math.nan)
        if engine.keep_spectra:
            row.setdefault(column(name, SPECTRA), [])
    return row


def score(
    data: str | Path | None = None, model: str | None = None, out: str | Path | None = None, *,
    template: str = "plain", modules: str | list[str] = "attn", max_length: int = 2048,
    batch_tokens: int = BATCH_TOKENS, device: str = "cpu", dtype: str = "float32", limit: int | None = None,
    fields: Fields = Fields(), save_spectra: bool = False, backend: str = "auto", progress: bool = True,
    trust_remote_code: bool = False, overwrite: bool = False, method: str = "exact", rank: int = 64,
    seed: int = 0, classic: bool = False,
) -> pd.DataFrame:
    """Scores a dataset file (default: HumanEval) with a model (default: SmolLM2-135M-Instruct).

    With ``out``, rows are written to that Parquet file as they finish and the file is read
    back at the end; the returned DataFrame is one row per input sample, in input order.
    """
    if out is not None and Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite or choose another --out")
    net, tokenizer = load_model(model, device, dtype, trust_remote_code)
    engine = SpectralEngine(net, modules, backend=backend, keep_spectra=save_spectra, method=method, rank=rank,
                            seed=seed, token_stats=classic)
    samples = humaneval_samples(limit) if data is None else read_samples(data, fields, limit)
    known = HUMANEVAL_SIZE if data is None else count_records(data)
    total = min((n for n in (known, limit) if n is not None), default=None)  # for the progress bar's ETA
    run_info = {
        "model": model or DEFAULT_MODEL, "data": str(data) if data else "humaneval", "template": template,
        "modules": modules if isinstance(modules, str) else ",".join(modules), "max_length": max_length,
        "dtype": dtype, "method": method, **({"rank": rank, "seed": seed} if method == "lowrank" else {}),
    }
    if out is None:
        return pd.DataFrame(score_samples(samples, engine, tokenizer, None, template, max_length,
                                          batch_tokens, progress, total))
    with ScoreWriter(out, engine.parts, engine.metric_names, save_spectra, run_info) as writer:
        score_samples(samples, engine, tokenizer, writer, template, max_length, batch_tokens, progress, total)
    return read_scores(out)[0]
