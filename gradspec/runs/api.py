"""The public scoring API: ``score`` and ``align`` (gradspec.score, gradspec.align), a dataset's
rows scored into a DataFrame, through a run folder when an output file is given."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from gradspec.align.task import DEFAULT_AGGREGATES, check_aggregates
from gradspec.data.batching import batch_tokens_for
from gradspec.data.errors import check_at_least
from gradspec.data.readers import Fields, Hub
from gradspec.runs.chunks import score_samples
from gradspec.runs.config import ScoreConfig, check_settings, typed
from gradspec.runs.run_folder import CHUNK_ROWS
from gradspec.runs.score_files import read_scores
from gradspec.runs.scoring import load_engine, run


def score(
    data: str | Path | None = None, model: str | Path | None = None, out: str | Path | None = None, *,
    template: str = "plain", modules: str | list[str] = "attn", max_length: int = 2048,
    batch_tokens: int | None = None, device: str | torch.device = "cpu", dtype: str = "float32",
    limit: int | None = None, fields: Fields | Mapping[str, str] = Fields(), save_spectra: bool = False,
    backend: str = "auto", progress: bool = True, trust_remote_code: bool = False, overwrite: bool = False,
    resume: bool = False, method: str = "exact",
    rank: int = 64, seed: int = 0, classic: bool = False, on_error: str = "fail", chunk_rows: int = CHUNK_ROWS,
    precision: str = "fp64", task: str | Path | None = None, aggregate: str | list[str] = DEFAULT_AGGREGATES,
    spectra: bool = True, project: int = 0, split: str = "train", config_name: str | None = None,
    streaming: bool = False, fsdp: bool = False, device_map: str | None = None,
) -> pd.DataFrame:
    """Scores a dataset file (default: HumanEval) with a model (default: SmolLM2-135M-Instruct).

    Returns one row per input sample, in input order. With ``out``, rows are written to that
    Parquet file chunk by chunk (see ``run``: resume, shards, torchrun) and read back at the end.
    With ``task`` (a file of examples of the task one cares about), each row also gets the cosines of
    its gradient with the task's ("align_<aggregate>" per module and over the whole scored model);
    spectra=False leaves the spectral metrics out; project=k stores each sample's gradient under a
    k x k Kronecker projection per module (column projected_gradient: a store for `gradspec align --store`).
    data may also be a Hub dataset's name or a folder that ``datasets.load_dataset`` reads: split,
    config_name and streaming choose what of it is read. fields: a Fields, or a dict of its names to
    the input's column names (fields={"instruction": "prompt", "output": "answer"}).

    An argument of the wrong type is a TypeError that names it ("max_length must be an int, got str
    '64'"), raised before anything loads; paths may be str or pathlib.Path, modules and aggregate a
    list of str, device a torch.device.
    """
    out, device, batch_tokens = typed("out", out, "path?"), typed("device", device, "device"), \
        typed("batch_tokens", batch_tokens, "int?")
    for name, value, kind in (("backend", backend, "str"), ("on_error", on_error, "str"),
                              ("device_map", device_map, "str?"), ("progress", progress, "bool"),
                              ("trust_remote_code", trust_remote_code, "bool"), ("overwrite", overwrite, "bool"),
                              ("resume", resume, "bool"), ("fsdp", fsdp, "bool")):
        typed(name, value, kind)
    hub = Hub(typed("split", split, "str"), typed("config_name", config_name, "str?"),
              typed("streaming", streaming, "bool"))
    config = ScoreConfig(  # checks the types of the rest (ScoreConfig.__post_init__)
        data, model, template, modules, max_length, dtype, method, rank, seed, classic, save_spectra, fields, limit,
        chunk_rows, precision, task, ",".join(check_aggregates(typed("aggregate", aggregate, "strs"))), spectra,
        project, hub,
    )
    check_at_least({"max_length": config.max_length, "chunk_rows": config.chunk_rows, "rank": config.rank,
                    "limit": config.limit, "batch_tokens": batch_tokens})  # as Python names them, before the flags
    check_at_least({"project": config.project}, 0)
    settings = {"device": device, "backend": backend, "batch_tokens": batch_tokens, "progress": progress,
                "trust_remote_code": trust_remote_code, "device_map": device_map}
    if fsdp and out is None:
        raise ValueError("fsdp: give out (a Parquet file): the ranks write their rows there")
    if out is not None:
        run(config, out, resume=resume, overwrite=overwrite, on_error=on_error, fsdp=fsdp, **settings)
        return read_scores(out)[0]
    check_settings(config, device, batch_tokens, device_map)
    batch_tokens = batch_tokens or batch_tokens_for(device, device_map)
    engine, tokenizer, _ = load_engine(config, device, backend, trust_remote_code, batch_tokens, progress, device_map)
    rows: list[dict[str, Any]] = []
    with engine:
        score_samples(config.samples(on_error=on_error), engine, tokenizer, lambda _, chunk: rows.extend(chunk),
                      config.chunk_rows, config.template, config.max_length, batch_tokens, progress, config.records())
    return pd.DataFrame(rows)


def align(data: str | Path | None, task: str | Path, model: str | None = None, out: str | Path | None = None, *,
          aggregate: str | list[str] = DEFAULT_AGGREGATES, spectra: bool = False, **options: Any) -> pd.DataFrame:
    """Exact gradient alignment of each sample of data with the examples of task: ``score`` with a
    task, the spectral metrics only if asked (options: any of score's)."""
    return score(data, model, out, task=task, aggregate=aggregate, spectra=spectra, **options)
