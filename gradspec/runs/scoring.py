"""Scoring a dataset chunk by chunk: read in order, bucket by length, batch under a token budget, write in order."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import reprlib
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from importlib.metadata import version
from itertools import chain, groupby, islice
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from gradspec.align.task import DEFAULT_AGGREGATES, check_aggregates
from gradspec.data.batching import BATCH_TOKENS, Item, batch_tokens_for, pad_batch, pad_id_of, token_batches
from gradspec.data.errors import check_at_least, check_parquet_out, check_writable
from gradspec.data.hub import is_dataset_name, loaded_once
from gradspec.data.models import (
    DEFAULT_MODEL,
    check_device,
    check_device_map,
    check_model,
    input_device,
    load_model,
    placement,
)
from gradspec.data.readers import (
    HUMANEVAL_SIZE,
    Fields,
    Hub,
    InputError,
    Sample,
    SampleStream,
    count_records,
    data_samples,
    mixed_columns,
    mixed_columns_of,
    read_samples,
    with_text_columns,
)
from gradspec.data.templates import RESPONSE_CHECK_ROWS, check_response_tokens, tokenize
from gradspec.engine import batch_memory
from gradspec.engine.batch_memory import BatchMemory
from gradspec.engine.spectral_engine import BatchScores, SpectralEngine
from gradspec.runs.classic_scores import CLASSIC_COLUMNS, loss_ratios, losses_alone, response_text
from gradspec.runs.distributed import Group, bind_device, torchrun_shard
from gradspec.runs.fsdp import load_sharded, lockstep_engine
from gradspec.runs.run_folder import CHUNK_ROWS, INPUT_ERROR, MODEL_IDENTITY, RunFolder, Shard, model_identity
from gradspec.runs.score_files import (
    METADATA_KEY,
    PROJECTION,
    ROUTED_TOKENS,
    SPECTRA,
    carried_name,
    column,
    file_metadata,
    metric_columns,
    read_scores,
)
from gradspec.runs.task_set import task_batches

log = logging.getLogger("gradspec")


def submit_with_split(
    engine: SpectralEngine, batch: list[Item], pad_id: int
) -> list[tuple[Item, Future[BatchScores] | None, int]]:
    """(item, future scores, row in them) for each item. Out of memory: split the batch in half
    and retry each half; a single sample that still does not fit gets None (flagged by the caller)."""
    try:
        result = engine.submit(*pad_batch([b.tokens for b in batch], pad_id, "cpu"))  # the engine moves it
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(batch) == 1:
            log.warning("sample %d does not fit in memory (%d tokens); flagged out_of_memory",
                        batch[0].sample.index, batch[0].tokens.num_tokens)
            return [(batch[0], None, 0)]
        log.warning("out of memory on a batch of %d; retrying it in two halves", len(batch))
        half = len(batch) // 2
        return (submit_with_split(engine, batch[:half], pad_id)
                + submit_with_split(engine, batch[half:], pad_id))
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


def _error_row(sample: Sample) -> dict[str, Any]:
    """A row skipped for bad input (on_error="skip"): why, and nothing scored."""
    log.warning("skipped: %s", sample.error)
    return {"index": sample.index, "status": INPUT_ERROR, "error": sample.error, "loss": math.nan,
            "num_tokens": 0, "num_response_tokens": 0}


class _Progress:
    """A progress bar with samples/s, tokens/s and the ETA."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="sample", disable=not enabled, dynamic_ncols=True)
        self.start, self.tokens = time.perf_counter(), 0

    def advance(self, samples: int, tokens: int = 0) -> None:
        self.tokens += tokens
        self.bar.update(samples)
        self.bar.set_postfix(tok_s=f"{self.tokens / (time.perf_counter() - self.start):.0f}", refresh=False)


_MEASURED: weakref.WeakKeyDictionary[SpectralEngine, BatchMemory] = weakref.WeakKeyDictionary()


class _BatchPlan:
    """Whether a batch fits in memory (gradspec.engine.batch_memory), from probes run once per engine,
    on the first batch to plan, against the memory available then (fixed for the run: memory the run
    itself freed is not reported available again on the host). Not used where the model lies on
    several devices or runs in lockstep under FSDP (a probe would have to run on every rank)."""

    def __init__(self, engine: SpectralEngine, pad_id: int) -> None:
        self.engine, self.pad_id = engine, pad_id
        self.memory: BatchMemory | None = None
        self.budget = 0.0
        model = engine.model
        self.enabled = (engine.lockstep is None and getattr(model, "hf_device_map", None) is None
                        and len({p.device for p in model.parameters()}) == 1)

    def fits(self, rows: int, longest: int) -> bool:
        if not self.enabled:
            return True
        if self.memory is None:
            device = input_device(self.engine.model)
            if self.engine not in _MEASURED:
                _MEASURED[self.engine] = batch_memory.measure(self.engine, self.pad_id, device)
            self.memory = _MEASURED[self.engine]
            self.budget = batch_memory.HEADROOM * batch_memory.available_bytes(device)
            log.info("batches planned within %.1f GiB: %.0f KiB per token, Grams of %d inputs",
                     self.budget / 2**30, self.memory.per_token / 2**10, len(self.memory.inputs))
        return self.memory.fits(rows, longest, self.budget)


def _score_chunk(samples: list[Sample], engine: SpectralEngine, tokenizer, template: str, max_length: int,
                 batch_tokens: int, progress: _Progress, plan: _BatchPlan | None = None) -> list[dict[str, Any]]:
    """Output rows of consecutive samples, in their order; batches within are sorted by length
    (and sized to fit memory by plan)."""
    pad_id = pad_id_of(tokenizer)
    items = [Item(s, tokenize(s.messages, tokenizer, template, max_length)) for s in samples if s.error is None]
    rows = {item.sample.index: _row(item) for item in items}
    rows.update({s.index: _error_row(s) for s in samples if s.error is not None})
    scorable = [i for i in items if i.tokens.scorable]
    # One batch in flight: its eigen stage runs while the next batch's forward and backward do.
    pending: list[tuple[Item, Future[BatchScores] | None, int]] = []
    for batch in token_batches(scorable, batch_tokens, fits=None if plan is None else plan.fits):
        submitted = submit_with_split(engine, batch, pad_id)
        progress.advance(len(pending), _collect(pending, rows, engine.metric_names))
        pending = submitted
    progress.advance(len(pending), _collect(pending, rows, engine.metric_names))
    if engine.token_stats:
        _add_classic(engine, tokenizer, scorable, rows, max_length, batch_tokens)
    progress.advance(len(samples) - len(scorable))
    return [_fill(rows[s.index], engine) for s in samples]


def score_samples(
    samples: Iterable[Sample], engine: SpectralEngine, tokenizer, write: Callable[[int, list[dict[str, Any]]], None],
    chunk_rows: int = CHUNK_ROWS, template: str = "plain", max_length: int = 2048,
    batch_tokens: int = BATCH_TOKENS, progress: bool = True, total: int | None = None,
) -> Counter[str]:
    """Scores samples chunk by chunk (chunk = index // chunk_rows); write(chunk, rows) gets each
    chunk's rows in input order. Returns how many rows got each status.

    Before any chunk, stops (ValueError) if most of the input's first RESPONSE_CHECK_ROWS rows have no
    response tokens (templates.check_response_tokens): samples' head (a SampleStream: the input's,
    whatever chunks this process scores), or else the first of samples themselves. A malformed row
    (InputError) stops the run too, once every chunk wholly before it is scored and written: a
    --resume after the row is fixed starts at the chunk that holds it.
    """
    statuses: Counter[str] = Counter()
    stopped: list[InputError] = []  # the malformed row that ended the stream, if one did
    stream: Iterator[Sample] = _until_error(samples, stopped)
    if isinstance(samples, SampleStream):
        head = samples.head(RESPONSE_CHECK_ROWS)
    else:
        head = list(islice(stream, RESPONSE_CHECK_ROWS))
        stream = chain(head, stream)
    _check_head(head, tokenizer, template, max_length)
    bar = _Progress(total, progress)
    plan = _BatchPlan(engine, pad_id_of(tokenizer))
    try:
        for chunk, group in groupby(stream, key=lambda s: s.index // chunk_rows):
            chunk_samples = list(group)  # reading past the chunk's last row may end the stream
            if stopped and not _before(stopped[0], chunk, chunk_rows, len(chunk_samples)):
                break  # the malformed row is in this chunk: it cannot be written whole
            text = mixed_columns(chunk_samples)  # none for a JSON or JSONL input: its types are the input's
            chunk_samples = [with_text_columns(s, text) for s in chunk_samples]
            rows = _score_chunk(chunk_samples, engine, tokenizer, template, max_length, batch_tokens, bar, plan)
            write(chunk, rows)
            statuses.update(row["status"] for row in rows)
    finally:
        bar.bar.close()
    if stopped:
        raise stopped[0]
    return statuses


def _until_error(samples: Iterable[Sample], stopped: list[InputError]) -> Iterator[Sample]:
    """samples up to the first InputError, which is put in stopped instead of raised."""
    try:
        yield from samples
    except InputError as e:
        stopped.append(e)


def _before(error: InputError, chunk: int, chunk_rows: int, rows: int) -> bool:
    """Whether a chunk (rows: how many of its rows were read) lies wholly before the malformed row of
    error: the row's index says (readers.RowError); without one, only a chunk read in full does."""
    index = getattr(error, "index", None)
    return rows == chunk_rows if index is None else index // chunk_rows > chunk


def _check_head(head: list[Sample], tokenizer, template: str, max_length: int) -> None:
    """A run stops before it scores anything where most of the input's first rows (head; malformed
    ones aside) have no response tokens: judged on the same rows in every process of a run."""
    statuses = Counter(tokenize(s.messages, tokenizer, template, max_length).status for s in head if s.error is None)
    check_response_tokens(statuses, f"the input's first {len(head)} rows")


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
    flags = [f for f in (row["status"], result.status(k)) if f != "ok"]
    row["status"], row["loss"] = ";".join(flags) or "ok", float(result.loss[k])
    row.update(metric_columns(result.metrics, k, names))
    row.update({column(name, ROUTED_TOKENS): int(counts[k]) for name, counts in result.routed_tokens.items()})
    for name, sigmas in result.spectra.items():
        row[column(name, SPECTRA)] = sigmas[k].tolist()
    row.update({name: float(values[k]) for name, values in result.token_stats.items()})
    row.update({name: float(values[k]) for name, values in result.alignment.items()})
    if result.projection is not None and bool(torch.isfinite(result.projection[k]).all()):
        row[PROJECTION] = result.projection[k].numpy()


def _fill(row: dict[str, Any], engine: SpectralEngine) -> dict[str, Any]:
    """Unscored rows get NaN metrics (their status says why), so every row has every column."""
    if engine.token_stats:
        for name in CLASSIC_COLUMNS:
            row.setdefault(name, math.nan)
    if engine.task is not None:
        for name in engine.task.metric_names:
            row.setdefault(name, math.nan)
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


# What each ScoreConfig field takes (_typed's kinds; "?": or None); fields and hub are checked apart
_FIELD_KINDS = {
    "data": "path?", "model": "path?", "template": "str", "modules": "strs", "max_length": "int", "dtype": "str",
    "method": "str", "rank": "int", "seed": "int", "classic": "bool", "save_spectra": "bool", "limit": "int?",
    "chunk_rows": "int", "precision": "str", "task": "path?", "aggregate": "strs", "spectra": "bool", "project": "int",
}
_KIND_WORDS = {"int": "an int", "bool": "a bool", "str": "a str", "strs": "a str or a list of str",
               "path": "a str or a pathlib.Path", "device": "a str or a torch.device"}


def _typed(name: str, value: Any, kind: str) -> Any:
    """value, if it is of kind (_KIND_WORDS; with "?" after it, None too), in the form a run keeps: an
    integral number (not a bool) as an int, a path as a str, a list of str joined by commas, a
    torch.device as its name; else a TypeError that names the parameter as Python code passes it."""
    optional, kind = kind.endswith("?"), kind.rstrip("?")
    if value is None and optional:
        return None
    if kind == "int" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind != "int" and kind != "bool" and isinstance(value, str):
        return value
    if kind == "path" and isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return os.fspath(value)
    if kind == "strs" and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if kind == "device" and isinstance(value, torch.device):
        return str(value)
    raise TypeError(f"{name} must be {_KIND_WORDS[kind]}{' or None' if optional else ''}, got "
                    f"{type(value).__name__} {reprlib.repr(value)}")


def _fields(value: Any) -> Fields:
    """fields as a Fields: one, or a dict of Fields' names (instruction, input, output, messages,
    conversations) to the input's column names, the others left at their defaults; that is how a
    run's manifest writes them, and what a dict of "which column holds what" means."""
    names = [f.name for f in dataclasses.fields(Fields)]
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise TypeError(f"fields has no name {unknown[0]!r}: a dict's keys are Fields' names ({', '.join(names)}) "
                            f"and its values the input's column names, e.g. fields={{'instruction': 'prompt'}}")
        return Fields(**{k: _typed(f"fields[{k!r}]", v, "str") for k, v in value.items()})
    if not isinstance(value, Fields):
        raise TypeError(f"fields must be a gradspec.Fields or a dict of its names to column names, got "
                        f"{type(value).__name__} {reprlib.repr(value)}")
    for name in names:
        _typed(f"fields.{name}", getattr(value, name), "str")
    return value


def _hub(value: Any) -> Hub:
    """hub as a Hub (a dict of its fields too, as a manifest writes it), each field of its type."""
    if isinstance(value, Mapping):
        value = Hub(**value)
    if not isinstance(value, Hub):
        raise TypeError(f"hub must be a Hub, got {type(value).__name__} {reprlib.repr(value)}")
    for name, kind in (("split", "str"), ("name", "str?"), ("streaming", "bool")):
        _typed(f"hub.{name}", getattr(value, name), kind)
    return value


@dataclass(frozen=True)
class ScoreConfig:
    """Everything that decides a run's output; a run resumes only under the same config."""

    data: str | None = None  # None: HumanEval
    model: str | None = None  # None: SmolLM2-135M-Instruct
    template: str = "plain"
    modules: str = "attn"
    max_length: int = 2048
    dtype: str = "float32"
    method: str = "exact"
    rank: int = 64
    seed: int = 0
    classic: bool = False
    save_spectra: bool = False
    fields: Fields = Fields()
    limit: int | None = None
    chunk_rows: int = CHUNK_ROWS
    precision: str = "fp64"  # of the Grams and sketch products (gradspec.linalg.policy)
    task: str | None = None  # a task file: add the cosines of each sample's gradient with its examples'
    aggregate: str = ",".join(DEFAULT_AGGREGATES)
    spectra: bool = True
    project: int = 0  # k: store each sample's gradient under a k x k Kronecker projection per part
    hub: Hub = Hub()  # the split, configuration and streaming of data read through `datasets`

    def __post_init__(self) -> None:
        """Every field checked for its type where the config is made, so that a wrong one (say
        max_length="64") is named, not met deep inside the run; kept in plain form (_typed: a path
        as a str, a list of modules joined by commas), fields and hub given as dicts made theirs."""
        for name, kind in _FIELD_KINDS.items():
            object.__setattr__(self, name, _typed(name, getattr(self, name), kind))
        object.__setattr__(self, "fields", _fields(self.fields))
        object.__setattr__(self, "hub", _hub(self.hub))

    def describe(self) -> dict[str, Any]:
        """The manifest and file metadata: the config, the input files' sizes and the version."""
        info = {**asdict(self), "model": self.model or DEFAULT_MODEL, "data": self.data or "humaneval",
                "version": version("gradspec")}
        for key in ("data", "task"):
            path = getattr(self, key)
            if path is not None:
                local = Path(path).exists()  # else a Hub dataset's name, kept as given
                info[key] = str(Path(path).resolve()) if local else path
                info[f"{key}_bytes"] = Path(path).stat().st_size if Path(path).is_file() else None
        if self.data is None or Path(self.data).is_file():  # a local file: no split to choose
            del info["hub"]
        if self.method != "lowrank":
            del info["rank"]
        if self.method != "lowrank" and not self.project:
            del info["seed"]
        if not self.project:
            del info["project"]
        if self.task is None:  # a spectra run describes itself as before alignment existed
            del info["task"], info["aggregate"]
        if self.task is None and not self.project:
            del info["spectra"]
        return info

    @classmethod
    def from_manifest(cls, info: dict[str, Any]) -> ScoreConfig:
        """The config a run was started with, from its manifest or its score file's metadata
        (describe's output; what describe leaves out takes its default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        options = {k: v for k, v in info.items() if k in names}
        options["data"] = None if info.get("data") == "humaneval" else info.get("data")
        options["model"] = None if info.get("model") == DEFAULT_MODEL else info.get("model")
        options["fields"] = Fields(**info.get("fields", {}))
        options["hub"] = Hub(**info.get("hub", {}))
        return cls(**options)

    def check(self) -> None:
        """Every option that can be checked before the model loads: a clear error for each."""
        check_at_least({"--max-length": self.max_length, "--chunk-rows": self.chunk_rows, "--rank": self.rank,
                        "--limit": self.limit})
        check_at_least({"--k": self.project}, 0)
        if not self.spectra and self.task is None and not self.project:
            raise ValueError("nothing to compute: spectra are off, and neither a task file nor a projection is given")
        if self.hub != Hub() and self.data is not None and Path(self.data).is_file():
            raise ValueError(f"--split, --config-name and --streaming apply to data read through datasets (a Hub "
                             f"name or a folder); {self.data} is a file")
        for flag, path in (("--data", self.data), ("--target", self.task)):
            if path is not None and not Path(path).exists() and not is_dataset_name(path):
                raise InputError(f"{flag} {path}: no such file or folder (nor a Hub dataset name: org/name)")
            if path is not None and Path(path).suffix == ".parquet" and Path(path).is_file() and \
                    METADATA_KEY in (pq.read_schema(path).metadata or {}):
                raise InputError(f"{flag} {path}: a file gradspec wrote (scores, a store), not training data; "
                                 "pass the data it scored")
        check_model(self.model)

    def records(self) -> int:
        """Rows the run covers: the input's, up to the limit (the limit, for a streamed split
        whose size its metadata does not give)."""
        try:
            n = HUMANEVAL_SIZE if self.data is None else count_records(self.data, self.hub)
        except InputError:
            if self.limit is None or not self.hub.streaming:
                raise
            return self.limit
        return n if self.limit is None else min(n, self.limit)

    def samples(self, wanted: Callable[[int], bool] | None = None, on_error: str = "fail") -> SampleStream:
        """The rows wanted, in order, each carried column typed as in the whole input (a column whose
        values mix kinds, as text: readers.mixed_columns_of), and the input's head (SampleStream)."""
        def stream() -> Iterator[Sample]:
            text = mixed_columns_of(self.data, self.fields, self.limit, self.hub)  # read at the first row
            for sample in data_samples(self.data, self.fields, self.limit, wanted, on_error, self.hub):
                yield with_text_columns(sample, text)

        def head(n: int) -> Iterator[Sample]:
            limit = n if self.limit is None else min(n, self.limit)
            return data_samples(self.data, self.fields, limit, on_error="skip", hub=self.hub)

        return SampleStream(stream(), head)


def _check(config: ScoreConfig, device: str, batch_tokens: int | None, device_map: str | None = None) -> None:
    config.check()
    check_device_map(device_map, device)
    check_device(device)
    if batch_tokens is not None:
        check_at_least({"--batch-tokens": batch_tokens})


def _engine(config: ScoreConfig, device: str, backend: str, trust_remote_code: bool,
            batch_tokens: int = BATCH_TOKENS, progress: bool = True, device_map: str | None = None,
            fsdp: bool = False):
    """(engine, tokenizer, how the model was placed: None, or its sharding or device map)."""
    def load(where: str):
        return load_model(config.model, where, config.dtype, trust_remote_code, progress, device_map)

    if fsdp:
        net, tokenizer, placed = load_sharded(load, device)
    else:
        net, tokenizer = load(device)
        placed = placement(net, device_map)
    engine = SpectralEngine(net, config.modules, backend=backend, keep_spectra=config.save_spectra,
                            precision=config.precision, method=config.method, rank=config.rank, seed=config.seed,
                            token_stats=config.classic, spectra=config.spectra, project=config.project)
    if fsdp:
        lockstep_engine(engine, device)
    if config.task is not None:  # under FSDP in lockstep: every rank runs the task's passes
        batches = task_batches(config.task, tokenizer, config.fields, config.template, config.max_length,
                               batch_tokens, input_device(net))
        engine.set_task(batches, config.aggregate)
    return engine, tokenizer, placed


@loaded_once()
def run(
    config: ScoreConfig, out: str | Path, *, device: str = "cpu", backend: str = "auto",
    batch_tokens: int | None = None, progress: bool = True, trust_remote_code: bool = False,
    resume: bool = False, overwrite: bool = False, shard: Shard | None = None, on_error: str = "fail",
    merge: bool = True, fsdp: bool = False, device_map: str | None = None,
) -> Counter[str]:
    """Scores this process's chunks into the run folder of out, then merges them into out when
    this process is the whole run (or rank 0 of torchrun's) and merge is on.

    Under torchrun every rank takes its own shard; shard splits the data between independent
    processes (e.g. a Slurm array) that share the folder; `gradspec merge` joins their parts.
    fsdp: under torchrun, the model's parameters sharded across the ranks (gradspec.runs.fsdp).
    device_map: one process, the model dispatched over the visible devices (data.models.DEVICE_MAPS).
    batch_tokens: padded tokens per batch at most (None: data.batching.batch_tokens_for the device).
    Returns how many rows of each status this process wrote.
    """
    ranks = torchrun_shard()
    if ranks is not None and shard is not None:
        raise ValueError("--shard and torchrun both split the data; use one of them")
    if fsdp and ranks is None:
        raise ValueError("--fsdp shards the model across torchrun's processes: run it under torchrun with "
                         "--nproc-per-node 2 or more")
    if fsdp and config.classic:
        raise ValueError("--fsdp and --classic: the classic scores' extra passes are not run in lockstep; "
                         "score them in a run without --fsdp")
    if device_map is not None and ranks is not None:
        raise ValueError("--device-map spreads one process's model over the visible GPUs; under torchrun each "
                         "rank has its own GPU: use --fsdp to shard a model too large for one")
    mine = ranks or shard or Shard()
    _check(config, device, batch_tokens, device_map)
    batch_tokens = batch_tokens or batch_tokens_for(device, device_map)
    if resume and overwrite:
        raise ValueError("--resume continues a run, --overwrite starts it again: pass one of them")
    check_parquet_out(out)
    check_writable(out)
    # The model as found on disk (its folder, a fingerprint of its files), not as named: None until
    # it is on this machine (a Hub id not in the cache yet), then taken after it loads.
    identity = model_identity(config.model) if ranks is None or mine.index == 0 else None
    if ranks is None or mine.index == 0:  # an --out in the way, before the model loads (rank 0 checks for torchrun)
        RunFolder(out).check({**config.describe(), **(identity or {})}, resume, overwrite,
                             shards=1 if ranks else mine.count, shard=None if ranks else mine,
                             unknown=() if identity else MODEL_IDENTITY)
    records = config.records()  # reads the input's size: a bad path, split or config shows here
    if records == 0:
        raise InputError(f"{config.data}: no rows to score")
    if on_error == "fail":  # the first row's layout, before the model loads
        next(iter(config.samples(lambda i: i == 0)), None)
    if config.task is not None:  # the task file likewise
        if count_records(config.task) == 0:
            raise InputError(f"--target {config.task}: no rows")
        next(iter(read_samples(config.task, config.fields, wanted=lambda i: i == 0)), None)
    with Group(collectives=fsdp and device.startswith("cuda")) if ranks else nullcontext() as group:
        # A torchrun rank makes its own GPU current before anything touches CUDA (bind_device)
        device = bind_device(device) if ranks else device
        engine, tokenizer, sharding = _engine(config, device, backend, trust_remote_code, batch_tokens, progress,
                                              device_map, fsdp)
        folder = RunFolder(out)
        if group is None or group.rank == 0:  # torchrun's other ranks take rank 0's
            identity = identity or model_identity(config.model) or \
                {"model_path": config.model or DEFAULT_MODEL, "model_fingerprint": None}
        info = {**config.describe(), **(identity or {})}
        if group is not None:
            info = group.share(info)  # one description of the run, in every rank's parts
        try:  # the lock this process takes in the run folder is released however the run ends, errors included
            created = False  # whether this process made the run folder (torchrun's rank 0 keeps it)
            if group is None:
                created = folder.start(info, resume, overwrite, shards=mine.count, records=records, shard=mine)
            else:  # rank 0 takes the lock and prepares the folder; the others check it, or stop with rank 0's error
                problem = None
                if group.rank == 0:
                    try:
                        folder.start(info, resume, overwrite, records=records)
                    except (FileExistsError, ValueError) as e:
                        problem = e
                problem = group.share(problem)
                if problem is not None:
                    raise problem
                if group.rank != 0:
                    folder.start(info, resume=True, overwrite=False, member=True)
            done = folder.done()

            def wanted(index: int) -> bool:
                chunk = index // config.chunk_rows
                return mine.owns(chunk) and chunk not in done

            total = sum(min(config.chunk_rows, records - start) for start in range(0, records, config.chunk_rows)
                        if wanted(start))  # rows of the chunks this process will score
            metadata = {**file_metadata(engine.parts, engine.metric_names, info), **engine.describe()}
            if sharding is not None:
                metadata["sharding"] = sharding
            if engine.projection is not None:
                metadata["projection"] = engine.projection.describe()
            if engine.task is not None:
                metadata["task_examples"] = {"kept": int(engine.task.kept.sum()), "rows": count_records(config.task)}
            try:
                statuses = score_samples(
                    config.samples(wanted, on_error), engine, tokenizer,
                    lambda chunk, rows: folder.write_part(chunk, rows, {**metadata, **engine.policy.describe()}),
                    config.chunk_rows, config.template,
                    config.max_length, batch_tokens, progress and (ranks is None or mine.index == 0), total,
                )
            except BaseException as e:
                if created:  # stopped before any part: leave no run to --resume (abandon keeps one with parts)
                    folder.abandon()
                if isinstance(e, InputError):  # a malformed row past the first
                    raise InputError(f"{e}; --on-error skip scores the other rows and lists the bad ones") from None
                raise
            finally:
                if engine.lockstep is not None:  # the other ranks' passes need this one's until all are done
                    engine.lockstep.drain()
                engine.close()  # no worker thread outlives the run
            if group is not None:
                group.wait()
            if merge and mine.index == 0 and (group is not None or mine.count == 1):
                folder.merge(records, config.chunk_rows)
        finally:
            folder.release()
    return statuses


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
    out, device, batch_tokens = _typed("out", out, "path?"), _typed("device", device, "device"), \
        _typed("batch_tokens", batch_tokens, "int?")
    for name, value, kind in (("backend", backend, "str"), ("on_error", on_error, "str"),
                              ("device_map", device_map, "str?"), ("progress", progress, "bool"),
                              ("trust_remote_code", trust_remote_code, "bool"), ("overwrite", overwrite, "bool"),
                              ("resume", resume, "bool"), ("fsdp", fsdp, "bool")):
        _typed(name, value, kind)
    hub = Hub(_typed("split", split, "str"), _typed("config_name", config_name, "str?"),
              _typed("streaming", streaming, "bool"))
    config = ScoreConfig(  # checks the types of the rest (ScoreConfig.__post_init__)
        data, model, template, modules, max_length, dtype, method, rank, seed, classic, save_spectra, fields, limit,
        chunk_rows, precision, task, ",".join(check_aggregates(_typed("aggregate", aggregate, "strs"))), spectra,
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
    _check(config, device, batch_tokens, device_map)
    batch_tokens = batch_tokens or batch_tokens_for(device, device_map)
    engine, tokenizer, _ = _engine(config, device, backend, trust_remote_code, batch_tokens, progress, device_map)
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
