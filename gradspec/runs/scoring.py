"""A scoring run, orchestrated: the combinations refused, the output and input checked before the
model loads, the engine made, the run folder prepared (torchrun's ranks agreeing on it), the files'
metadata, the chunk loop (gradspec.runs.chunks) into the folder's parts, and their merge."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from gradspec.data.batching import BATCH_TOKENS, batch_tokens_for
from gradspec.data.errors import InputError, OptionInputError, check_parquet_out, check_writable
from gradspec.data.hub import loaded_once
from gradspec.data.models import DEFAULT_MODEL, fit_to_context, input_device, load_model, placement
from gradspec.data.readers import count_records, read_samples
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.options import OptionError, mention
from gradspec.runs.chunks import Flush, score_samples
from gradspec.runs.config import ScoreConfig, check_settings
from gradspec.runs.distributed import Group, bind_device, torchrun_shard
from gradspec.runs.fsdp import load_sharded, lockstep_engine
from gradspec.runs.numerics import numerics
from gradspec.runs.preconditioning import run_preconditioner
from gradspec.runs.run_folder import MODEL_IDENTITY, NUMERICS, RunFolder, Shard, model_identity
from gradspec.runs.score_files import file_metadata
from gradspec.runs.task_set import task_examples

log = logging.getLogger("gradspec")


def load_engine(config: ScoreConfig, device: str, backend: str, trust_remote_code: bool,
                batch_tokens: int = BATCH_TOKENS, progress: bool = True, device_map: str | None = None,
                fsdp: bool = False):
    """(engine, tokenizer, how the model was placed: None, or its sharding or device map, the tokens kept per
    row: config's max_length, or the model's context where that is shorter, models.fit_to_context)."""
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
    max_length = fit_to_context(config.max_length, net)
    if config.task is not None:  # under FSDP in lockstep: every rank runs the task's passes
        batches, rows = task_examples(config.task, tokenizer, config.fields, config.template, max_length,
                                      batch_tokens, input_device(net))
        preconditioner = run_preconditioner(config, engine, net, tokenizer, max_length, batch_tokens,
                                            input_device(net), progress)
        engine.set_task(batches, config.aggregate, preconditioner=preconditioner, attribution=config.attribution,
                        example_rows=(rows, count_records(config.task)), progress=progress)
    return engine, tokenizer, placed, max_length


@loaded_once()
def run(
    config: ScoreConfig, out: str | Path, *, device: str = "cpu", backend: str = "auto",
    batch_tokens: int | None = None, progress: bool = True, trust_remote_code: bool = False,
    resume: bool = False, overwrite: bool = False, shard: Shard | None = None, on_error: str = "fail",
    merge: bool = True, fsdp: bool = False, device_map: str | None = None, flush_minutes: float = 10.0,
) -> Counter[str]:
    """Scores this process's chunks into the run folder of out, then merges them into out when
    this process is the whole run (or rank 0 of torchrun's) and merge is on.

    Under torchrun every rank takes its own shard; shard splits the data between independent
    processes (e.g. a Slurm array) that share the folder; `gradspec merge` joins their parts.
    fsdp: under torchrun, the model's parameters sharded across the ranks (gradspec.runs.fsdp).
    device_map: one process, the model dispatched over the visible devices (data.models.DEVICE_MAPS).
    batch_tokens: padded tokens per batch at most (None: data.batching.batch_tokens_for the device).
    flush_minutes: how often an unfinished chunk's rows are written (what a stop costs at most).
    Returns how many rows of each status this process wrote.
    """
    ranks = torchrun_shard()
    _refuse_combinations(config, ranks, shard, fsdp, device_map)
    mine = ranks or shard or Shard()
    check_settings(config, device, device_map)
    batch_tokens = batch_tokens or batch_tokens_for(device, device_map)
    identity, complete = check_out(config, out, ranks, mine, resume, overwrite, device, batch_tokens)
    if complete:  # resumed after its merge: nothing left to do
        log.info("%s is already complete: nothing to resume", out)
        return Counter(pq.read_table(out, columns=["status"])["status"].to_pylist())
    records = _check_input(config, on_error)
    with Group(collectives=fsdp and device.startswith("cuda")) if ranks else nullcontext() as group:
        # A torchrun rank makes its own GPU current before anything touches CUDA (bind_device)
        device = bind_device(device) if ranks else device
        shown = progress and (ranks is None or mine.index == 0)  # one bar: rank 0's
        engine, tokenizer, sharding, max_length = load_engine(config, device, backend, trust_remote_code,
                                                              batch_tokens, shown, device_map, fsdp)
        folder = RunFolder(out)
        info = run_info(config, group, identity, device, batch_tokens)
        try:  # the lock this process takes in the run folder is released however the run ends, errors included
            created = start_folder(folder, info, group, mine, resume, overwrite, records)
            wanted, total = _chunks_to_score(config, mine, folder.done(), records)
            metadata = run_metadata(config, engine, info, sharding)
            statuses = _score_into(folder, created, config, engine, tokenizer, metadata, wanted, on_error,
                                   max_length, batch_tokens, shown, total, flush_minutes)
            if group is not None:
                group.wait()
            if merge and mine.index == 0 and (group is not None or mine.count == 1):
                folder.merge(records, config.chunk_rows)
        finally:
            folder.release()
    return statuses


def _refuse_combinations(config: ScoreConfig, ranks: Shard | None, shard: Shard | None, fsdp: bool,
                         device_map: str | None) -> None:
    """The options that do not go together (ranks: torchrun's shard of this process, if under it)."""
    if ranks is not None and shard is not None:
        raise OptionError("shard", "and torchrun both split the data; use one of them")
    if fsdp and ranks is None:
        raise OptionError("fsdp", "shards the model across torchrun's processes: run it under torchrun with "
                          "--nproc-per-node 2 or more")
    if fsdp and config.classic:
        raise OptionError(("fsdp", "classic"), ": the classic scores' extra passes are not run in lockstep; "
                          "score them in a run without fsdp")
    if device_map is not None and ranks is not None:
        raise OptionError("device_map", "spreads one process's model over the visible GPUs; under torchrun each "
                          f"rank has its own GPU: use {mention('fsdp')} to shard a model too large for one")


def check_out(config: ScoreConfig, out: str | Path, ranks: Shard | None, mine: Shard, resume: bool,
              overwrite: bool, device: str, batch_tokens: int) -> tuple[dict[str, Any] | None, bool]:
    """An --out in the way, before the model loads (rank 0 checks for torchrun). Returns the model's
    identity as found on disk (its folder, a fingerprint of its files), not as named: None until it
    is on this machine (a Hub id not in the cache yet), then taken after it loads; and whether a
    resume finds out already complete (every rank sees the same file)."""
    if resume and overwrite:
        raise OptionError(("resume", "overwrite"), ": the first continues a run, the second starts it again; "
                          "pass one of them")
    check_parquet_out(out)
    check_writable(out)
    identity = model_identity(config.model) if ranks is None or mine.index == 0 else None
    info = {**config.describe(), **(identity or {}), NUMERICS: numerics(device, batch_tokens)}
    unknown = () if identity else MODEL_IDENTITY
    if resume and RunFolder(out).complete(info, unknown):
        return identity, True
    if ranks is None or mine.index == 0:
        RunFolder(out).check(info, resume, overwrite, shards=1 if ranks else mine.count,
                             shard=None if ranks else mine, unknown=unknown)
    return identity, False


def _check_input(config: ScoreConfig, on_error: str) -> int:
    """The rows the run covers, read before the model loads: a bad path, split or config shows here,
    as does (on_error "fail") a first row of the wrong layout, the input's or the task file's."""
    records = config.records()
    if records == 0:
        raise InputError(f"{config.data}: no rows to score")
    if on_error == "fail":  # the first row's layout, before the model loads
        next(iter(config.samples(lambda i: i == 0)), None)
    if config.task is not None:  # the task file likewise
        if count_records(config.task) == 0:
            raise OptionError("task", f"{config.task}: no rows")
        next(iter(read_samples(config.task, config.fields, wanted=lambda i: i == 0)), None)
    return records


def run_info(config: ScoreConfig, group: Group | None, identity: dict[str, Any] | None,
             device: str, batch_tokens: int) -> dict[str, Any]:
    """The run's description (config, model identity, numerics), the same in every rank's parts."""
    if group is None or group.rank == 0:  # torchrun's other ranks take rank 0's
        identity = identity or model_identity(config.model) or \
            {"model_path": config.model or DEFAULT_MODEL, "model_fingerprint": None}
    info = {**config.describe(), **(identity or {}), NUMERICS: numerics(device, batch_tokens)}
    if group is not None:
        info = group.share(info)  # one description of the run, in every rank's parts
    return info


def start_folder(folder: RunFolder, info: dict[str, Any], group: Group | None, mine: Shard, resume: bool,
                  overwrite: bool, records: int) -> bool:
    """Takes the run folder's lock and prepares it; returns whether this process made the folder
    (torchrun's rank 0 keeps it). Under torchrun rank 0 prepares it and the others check it, or stop
    with rank 0's error."""
    if group is None:
        return folder.start(info, resume, overwrite, shards=mine.count, records=records, shard=mine)
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
    return False


def _chunks_to_score(config: ScoreConfig, mine: Shard, done: set[int],
                     records: int) -> tuple[Callable[[int], bool], int]:
    """(whether a row is to be scored by this process: its chunk is this process's and not done,
    how many rows of the chunks this process will score)."""
    def wanted(index: int) -> bool:
        chunk = index // config.chunk_rows
        return mine.owns(chunk) and chunk not in done

    total = sum(min(config.chunk_rows, records - start) for start in range(0, records, config.chunk_rows)
                if wanted(start))
    return wanted, total


def run_metadata(config: ScoreConfig, engine: SpectralEngine, info: dict[str, Any],
                 sharding: Any) -> dict[str, Any]:
    """The metadata of each part (and so of the score file), the precision policy's aside."""
    metadata = {**file_metadata(engine.parts, engine.metric_names, info), **engine.describe()}
    if sharding is not None:
        metadata["sharding"] = sharding
    if engine.projection is not None:
        metadata["projection"] = engine.projection.describe()
    if engine.task is not None:
        metadata["task_examples"] = {"kept": int(engine.task.kept.sum()), "rows": count_records(config.task)}
        if engine.task.preconditioner is not None:
            metadata["preconditioner"] = engine.task.preconditioner.describe()
    return metadata


def _score_into(folder: RunFolder, created: bool, config: ScoreConfig, engine: SpectralEngine, tokenizer,
                metadata: dict[str, Any], wanted: Callable[[int], bool], on_error: str, max_length: int,
                batch_tokens: int, progress: bool, total: int, flush_minutes: float = 10.0) -> Counter[str]:
    """Scores the rows wanted into the folder's parts (score_samples), each cut to max_length tokens (load_engine's);
    the engine is closed however that ends. created: this process made the folder, which a run stopped before
    any part abandons."""
    try:
        return score_samples(  # a stream shorter than the limit: the run ends where it did (input_ended)
            config.samples(wanted, on_error, folder.input_ended), engine, tokenizer,
            lambda chunk, rows: folder.write_part(chunk, rows, {**metadata, **engine.policy.describe()}),
            config.chunk_rows, config.template, max_length, batch_tokens, progress, total,
            Flush(60 * flush_minutes, folder.write_partial, folder.partial_rows),
        )
    except BaseException as e:
        if created:  # stopped before any part: leave no run to --resume (abandon keeps one with parts)
            folder.abandon()
        if isinstance(e, InputError):  # a malformed row past the first
            raise OptionInputError((), f"{e}; {mention('on_error')} skip scores the other rows and lists the bad "
                                   "ones") from None
        raise
    finally:
        if engine.lockstep is not None:  # the other ranks' passes need this one's until all are done
            engine.lockstep.drain()
        engine.close()  # no worker thread outlives the run
