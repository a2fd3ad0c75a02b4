"""The public scoring API: ``score`` and ``align`` (gradspec.score, gradspec.align), a dataset's
rows scored into a DataFrame, through a run folder when an output file is given."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import pandas as pd

from gradspec.data.batching import batch_tokens_for
from gradspec.data.in_memory import holding
from gradspec.options import expose, split_options, typed
from gradspec.runs.chunks import score_samples
from gradspec.runs.config import RunSettings, ScoreConfig, check_settings
from gradspec.runs.score_files import read_scores
from gradspec.runs.scoring import load_engine, run

if TYPE_CHECKING:
    from datasets import Dataset

Rows: TypeAlias = "Sequence[Mapping[str, Any]] | pd.DataFrame | Dataset"  # in memory (gradspec.data.in_memory)


def score(data: str | Path | Rows | None = None, model: str | Path | None = None, out: str | Path | None = None,
          **options: Any) -> pd.DataFrame:
    """Scores a dataset (default: HumanEval) with a model (default: SmolLM2-135M-Instruct).

    With ``task`` (examples of the task one cares about: a file, or the rows in memory), each row also
    gets the cosines of its gradient with the task's ("align_<aggregate>" per module and over the whole
    scored model);
    spectra=False leaves the spectral metrics out; project=k stores each sample's gradient under a
    k x k Kronecker projection per module (column projected_gradient: a store for `gradspec align --store`).

    Args:
        data: a JSON, JSONL or Parquet file, a folder or a Hub dataset's name that
            ``datasets.load_dataset`` reads (split, config_name and streaming choose what of it); or the
            rows themselves: a list of dicts, a pandas DataFrame or a ``datasets.Dataset``, read as a
            file's rows are (errors name a row data[i]; with out, the run records them by a hash of
            their content: a resume continues with the same rows only).
        model: a model folder or Hub name.
        out: a Parquet file: rows are written there chunk by chunk (a run folder beside it: resume,
            shards, torchrun) and read back at the end; None: kept in memory only.
        **options: any of the options below (ScoreConfig's: what is computed; RunSettings': how).
            An option of the wrong type is a TypeError that names it ("max_length must be an int, got
            str '64'"), and one out of range a ValueError, raised before anything loads; paths may be
            str or pathlib.Path, modules and aggregate a list of str, device a torch.device, fields a
            dict of Fields' names to the input's column names (fields={"instruction": "prompt"}).

    Returns:
        One row per input sample, in input order (columns: docs/runs-at-scale.md, output).
    """
    out = typed("out", out, "path?")
    given, settings_given = split_options(options, ScoreConfig, RunSettings, caller="score")
    with holding(data=data, task=given.pop("task", None)) as inputs:  # rows in memory: their label
        config = ScoreConfig(**inputs, model=model, **given)
        return _score(config, RunSettings(**settings_given), out)


def _score(config: ScoreConfig, settings: RunSettings, out: str | None) -> pd.DataFrame:
    """score's rows: through a run folder where out is given, else in memory."""
    if settings.fsdp and out is None:
        raise ValueError("fsdp: give out (a Parquet file): the ranks write their rows there")
    if out is not None:
        run(config, out, **asdict(settings))
        return read_scores(out)[0]
    check_settings(config, settings.device, settings.device_map)
    batch_tokens = settings.batch_tokens or batch_tokens_for(settings.device, settings.device_map)
    engine, tokenizer, _, max_length = load_engine(config, settings.device, settings.backend,
                                                   settings.trust_remote_code, batch_tokens, settings.progress,
                                                   settings.device_map)
    rows: list[dict[str, Any]] = []
    with engine:
        score_samples(config.samples(on_error=settings.on_error), engine, tokenizer,
                      lambda _, chunk: rows.extend(chunk), config.chunk_rows, config.template, max_length,
                      batch_tokens, settings.progress, config.records())
    return pd.DataFrame(rows)


def align(data: str | Path | Rows | None, task: str | Path | Rows, model: str | Path | None = None,
          out: str | Path | None = None, *, spectra: bool = False, **options: Any) -> pd.DataFrame:
    """Exact gradient alignment of each sample of data with the examples of task: ``score`` with a
    task, the spectral metrics only if asked.

    Args:
        data: the samples to align, as for ``score``.
        task: a file of examples of the task one cares about, or those examples in memory (same formats
            and fields as data).
        model: as for ``score``.
        out: as for ``score``.
        spectra: also the spectral metrics, in the same pass.
        **options: any of ``score``'s options (aggregate chooses the cosines).

    Returns:
        One row per sample of data, with align_<aggregate> columns per module and over the model.
    """
    return score(data, model, out, task=task, spectra=spectra, **options)


expose(score, ScoreConfig, RunSettings)
expose(align, ScoreConfig, RunSettings)
