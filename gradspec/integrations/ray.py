"""gradspec scoring as a Ray Data stage (``pip install 'gradspec[ray]'``): many rows over many actors.

``GradspecScorer`` is a callable class for ``Dataset.map_batches``: each actor loads the model once
(gradspec.runs.scoring.load_engine) and turns each batch of rows, in any layout gradspec reads (Alpaca,
chat messages, ShareGPT, prompt/completion; gradspec.Fields), into the rows ``gradspec score``
writes, through the same function (gradspec.runs.chunks.score_samples): the same columns, statuses and
flags. A row that cannot be read is its row's ``input_error``, never a failed job.

``score_dataset`` (and ``gradspec ray-score``) runs the whole pipeline: the input (JSON, JSONL or Parquet
files or folders, local or on any filesystem pyarrow reaches) is cut into gradspec's chunks
(gradspec.integrations.chunked_files), one Ray block each; each actor scores a chunk and writes it as a
part of ``<out>.parts/`` exactly as ``gradspec score`` does (gradspec.runs.run_folder); the parts are
then merged into ``out``, a score file that read_scores, select, report and validate read. A chunk is
scored in the same batches as ``gradspec score`` scores it, so its rows are bit-identical under the
same numerics. An actor that dies is restarted by Ray and its chunk scored again (a part is written
whole or not at all); a stopped pipeline given ``resume`` scores only the chunks that have no part.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pyarrow as pa
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

from gradspec.data.carried_columns import mixed_columns_of, with_text_columns
from gradspec.data.errors import InputError
from gradspec.data.readers import RowError, Sample, SampleStream, to_sample
from gradspec.integrations.chunked_files import Chunk, describe, plan, read_chunk
from gradspec.options import OptionError, split_options
from gradspec.runs.config import RunSettings, ScoreConfig

log = logging.getLogger("gradspec")

# The columns of the blocks score_dataset reads: a row's index in the input, its location, its record
# (a dict, or the InputError confined to it) pickled, as gradspec's readers give it
INDEX, WHERE, RECORD = "_gradspec_index", "_gradspec_where", "_gradspec_record"
# What an actor returns where it writes parts: a row per chunk and status, with how many rows have it
WRITTEN = pa.schema([("chunk", pa.int64()), ("status", pa.string()), ("rows", pa.int64())])


@dataclass(frozen=True)
class Parts:
    """Where score_dataset's actors write: out's run folder, the run's description (its info, as its
    manifest holds it), how many rows the run covers, and the carried columns stored as text."""

    out: str
    info: dict[str, Any]
    records: int
    config: ScoreConfig
    text_columns: frozenset[str] = frozenset()


class GradspecScorer:
    """A Ray Data stage that scores rows: ``ds.map_batches(GradspecScorer, fn_constructor_kwargs={...},
    batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=N), num_gpus=G)``. Each actor loads the
    model once; each batch comes back as ``gradspec score``'s rows for it (index, status, loss, the metric
    columns, the input's other scalar columns carried), one per input row, in index order.

    The rows of a batch are scored chunk by chunk (index // chunk_rows) as ``gradspec score`` scores them:
    where each batch holds whole chunks of the input (index_column the row's position in it), its rows are
    bit-identical to ``gradspec score``'s under the same numerics; otherwise a row's metrics may differ in
    the last bits, as they do between batch sizes (docs/runs-at-scale.md#what-is-bit-identical).

    Args:
        model: a model folder or Hub name, on every node (default: SmolLM2-135M-Instruct).
        index_column: the input's column that numbers its rows (the output's index; not carried). None:
            the rows of each batch are numbered from 0, and the input's first rows checked for response
            tokens are each batch's.
        parts: score_dataset's: write each chunk as a part of a run folder, and return what was written.
        **options: ``gradspec.score``'s options (ScoreConfig's: what is computed; of RunSettings: device,
            batch_tokens, backend, trust_remote_code, on_error). on_error is "skip" here: a row that
            cannot be read is its row's input_error; "fail" fails the batch.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, index_column: str | None = None,
                 parts: Parts | None = None, **options: Any) -> None:
        from gradspec.runs.scoring import load_engine, run_metadata

        given, settings_given = split_options(options, ScoreConfig, RunSettings, caller="GradspecScorer")
        settings = RunSettings(**{"on_error": "skip", **settings_given})
        if parts is None:
            if "data" in given:
                raise OptionError("data", "is read by Ray Data: give the rows as the dataset's batches")
            config = ScoreConfig(model=None if model is None else os.fspath(model), **given)
            from gradspec.runs.config import check_settings

            check_settings(config, settings.device)
        else:
            config = parts.config
        _use_assigned_cpus()
        self.config, self.settings, self.index_column, self.parts = config, settings, index_column, parts
        self.batch_tokens = settings.batch_tokens or _batch_tokens(settings.device)
        self.engine, self.tokenizer, _, self.max_length = load_engine(
            config, settings.device, settings.backend, settings.trust_remote_code, self.batch_tokens, False)
        self.metadata = None if parts is None else run_metadata(config, self.engine, parts.info, None)

    def __call__(self, batch: pa.Table | Any) -> pa.Table:
        """The batch's rows scored (or, writing parts, the rows of WRITTEN: how many rows of each chunk have each
        status)."""
        from gradspec.data.templates import RESPONSE_CHECK_ROWS
        from gradspec.runs.chunks import score_samples
        from gradspec.runs.run_folder import RunFolder, rows_table

        samples = sorted(self._samples(batch), key=lambda s: s.index)
        indices = [s.index for s in samples]
        if len(set(indices)) != len(indices):
            raise ValueError(f"{self.index_column}: a batch holds an index more than once; each row needs its own")
        rows: list[dict[str, Any]] = []
        written: list[dict[str, Any]] = []
        folder = None if self.parts is None else RunFolder(self.parts.out)

        def write(chunk: int, chunk_rows: list[dict[str, Any]]) -> None:
            if folder is None:
                rows.extend(chunk_rows)
                return
            self._check_whole(chunk, chunk_rows)
            folder.write_part(chunk, chunk_rows, {**self.metadata, **self.engine.policy.describe()})
            statuses = Counter(row["status"] for row in chunk_rows)
            written.extend({"chunk": chunk, "status": s, "rows": n} for s, n in sorted(statuses.items()))

        # the input's first rows (the batch that holds them) are checked for response tokens, as score checks them
        head = [s for s in samples if s.index < RESPONSE_CHECK_ROWS]
        score_samples(SampleStream(iter(samples), lambda n: iter(head[:n])), self.engine, self.tokenizer, write,
                      self.config.chunk_rows, self.config.template, self.max_length, self.batch_tokens, False)
        if folder is not None:
            return pa.Table.from_pylist(written, schema=WRITTEN)
        table = rows_table(rows) if rows else pa.table({"index": pa.array([], pa.int64())})
        if "error" not in table.column_names:  # every batch's rows of one schema, the errors' column too
            table = table.append_column("error", pa.nulls(table.num_rows, pa.string()))
        return table

    def _samples(self, batch: Any) -> list[Sample]:
        """The batch's rows as samples, each read as gradspec's readers read a row (to_sample): a row that
        cannot be read is a sample whose error says why (on_error "skip"), or a RowError ("fail")."""
        samples = []
        for index, where, record in self._records(batch):
            try:
                if isinstance(record, InputError):
                    raise record
                sample = to_sample(index, where, record, self.config.fields)
            except InputError as e:
                if self.settings.on_error == "fail":
                    raise RowError(str(e), index) from None
                sample = Sample(index, [], error=str(e))
            samples.append(with_text_columns(sample, self.parts.text_columns) if self.parts else sample)
        return samples

    def _records(self, batch: Any) -> list[tuple[int, str, Any]]:
        """(index, location, record) per row of the batch: score_dataset's blocks carry them; any other
        batch's columns are the record's (index_column, where given, its index)."""
        from gradspec.data.formats import parquet_records
        from gradspec.data.in_memory import InMemoryRows

        if isinstance(batch, pa.Table) and RECORD in batch.column_names:
            return list(zip(batch[INDEX].to_pylist(), batch[WHERE].to_pylist(),
                            map(pickle.loads, batch[RECORD].to_pylist()), strict=True))
        if isinstance(batch, pa.Table):
            records = parquet_records(batch, "batch", 0)
        else:
            import pandas as pd

            frame = batch if isinstance(batch, pd.DataFrame) else pd.DataFrame(dict(batch))
            records = [record for _, record in InMemoryRows(frame, "batch").records()]
        out = []
        for k, record in enumerate(records):
            if isinstance(record, dict):  # a null: no field (Ray's batches give every row every column of the input)
                record = {name: value for name, value in record.items() if value is not None}
            index = k
            if self.index_column is not None and isinstance(record, dict):
                if record.get(self.index_column) is None:
                    raise ValueError(f"batch row {k}: no {self.index_column!r} (index_column)")
                index = int(record.pop(self.index_column))
            out.append((index, f"row {index}", record))
        return out

    def _check_whole(self, chunk: int, rows: list[dict[str, Any]]) -> None:
        """A part holds all of its chunk's rows (a merge checks that too): a batch cut in a chunk is a bug."""
        first = chunk * self.config.chunk_rows
        expected = list(range(first, min(first + self.config.chunk_rows, self.parts.records)))
        if [row["index"] for row in rows] != expected:
            raise RuntimeError(f"chunk {chunk}: a batch of rows {rows[0]['index']}-{rows[-1]['index']}, not the "
                               f"chunk's {first}-{expected[-1]}; give each batch whole chunks (batch_size=None)")


def _pool(concurrency: int | tuple[int, int]) -> Any:
    """Ray Data's pool of concurrency actors (a (min, max) pair: one that grows and shrinks between them)."""
    from ray.data import ActorPoolStrategy

    if isinstance(concurrency, tuple):
        return ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    return ActorPoolStrategy(size=concurrency)


def _batch_tokens(device: str) -> int:
    from gradspec.data.batching import batch_tokens_for

    return batch_tokens_for(device, None)


def _use_assigned_cpus() -> None:
    """torch's threads: the CPUs Ray gave this actor (its OMP_NUM_THREADS), as score_dataset records them in
    the run's numerics; left as they are outside Ray."""
    import ray
    import torch

    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))


class _Chunks(Datasource):
    """The input's chunks as Ray blocks, one each, of the INDEX, WHERE and RECORD columns."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self.chunks = chunks

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        return [ReadTask(partial(_block, chunk), BlockMetadata(num_rows=chunk.rows, size_bytes=None, exec_stats=None,
                                                               input_files=chunk.files))
                for chunk in self.chunks]


def _block(chunk: Chunk) -> list[pa.Table]:
    index, where, record = zip(*read_chunk(chunk), strict=True) if chunk.rows else ((), (), ())
    return [pa.table({INDEX: pa.array(index, pa.int64()), WHERE: pa.array(where, pa.string()),
                      RECORD: pa.array([pickle.dumps(r) for r in record], pa.binary())})]


_NOT_HERE = ("fsdp", "device_map", "flush_minutes")  # RunSettings' options a Ray run does not take


def score_dataset(data: str | os.PathLike, out: str | os.PathLike, model: str | os.PathLike | None = None, *,
                  concurrency: int | tuple[int, int] = 1, num_gpus: float = 0, num_cpus: float = 1,
                  merge: bool = True, **options: Any) -> Counter[str]:
    """Scores data into out with a pool of Ray actors (GradspecScorer), in the current Ray cluster (or a local
    one that ray.data starts): gradspec score's output and run folder, its resume included.

    Args:
        data: a JSON, JSONL or Parquet file, or a folder of them, local (on every node: a shared filesystem)
            or any URI pyarrow reads (s3://, gs://, hdfs://, ...).
        out: the .parquet score file, on a filesystem every actor writes (its parts go to <out>.parts/).
        model: a model folder or Hub name, on every node.
        concurrency: the actors (or (min, max) for an autoscaling pool).
        num_gpus: GPUs per actor (device cuda where above 0).
        num_cpus: CPUs per actor: torch's threads in it.
        merge: merge the parts into out at the end (False: leave them; ``gradspec merge --out`` joins them).
        **options: gradspec.score's options (resume, overwrite, on_error, batch_tokens, chunk_rows, ...;
            on_error is "skip" unless given: a bad row is its row's input_error).

    Returns:
        How many rows of each status this call scored (a resume: those it scored now).
    """
    import ray
    import torch

    from gradspec.runs.run_folder import RunFolder, Shard
    from gradspec.runs.scoring import check_out, run_info

    data, out = os.fspath(data), os.path.abspath(os.fspath(out))
    given, settings_given = split_options(options, ScoreConfig, RunSettings, caller="score_dataset")
    refused = [name for name in _NOT_HERE if name in settings_given]
    if refused:
        raise OptionError(refused, ": not for a Ray run (each actor holds the whole model; a kill costs a chunk)")
    device = settings_given.pop("device", "cuda" if num_gpus > 0 else "cpu")
    settings = RunSettings(**{"on_error": "skip", **settings_given, "device": device})
    config = ScoreConfig(data=data, model=None if model is None else os.fspath(model), **given)
    remote = "://" in data
    from gradspec.runs.config import check_settings

    check_settings(replace(config, data=None) if remote else config, "cpu" if num_gpus > 0 else device)
    batch_tokens = settings.batch_tokens or _batch_tokens(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(num_cpus)))  # the run's numerics are its actors' (_use_assigned_cpus)
    try:
        identity, complete = check_out(config, out, None, Shard(), settings.resume, settings.overwrite, device,
                                        batch_tokens)
        info = run_info(config, None, identity, device, batch_tokens)
    finally:
        torch.set_num_threads(threads)
    if complete:
        log.info("%s is already complete: nothing to resume", out)
        return Counter()
    chunks = plan(data, config.chunk_rows, config.limit)
    records = sum(c.rows for c in chunks)
    if records == 0:
        raise InputError(f"{data}: no rows to score")
    text = frozenset() if remote else frozenset(mixed_columns_of(data, config.fields, config.limit))
    folder = RunFolder(out)
    statuses: Counter[str] = Counter()
    try:
        folder.start(info, settings.resume, settings.overwrite, records=records)
        todo = [c for c in chunks if c.number not in folder.done()]
        log.info("%s: %s to score (of %s)", data, describe(todo), describe(chunks))
        if todo:
            parts = Parts(out, info, records, config, text)
            kwargs = {"parts": parts, "device": device, "batch_tokens": batch_tokens, "backend": settings.backend,
                      "trust_remote_code": settings.trust_remote_code, "on_error": settings.on_error}
            # a block per chunk (none cut), read by the actors themselves: a read asking what an actor asks is
            # fused into it (Ray Data's operator fusion), where a read of its own could wait for CPUs the actors hold
            resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
            done = ray.data.read_datasource(_Chunks(todo), override_num_blocks=len(todo), **resources).map_batches(
                GradspecScorer, fn_constructor_kwargs=kwargs, batch_size=None, batch_format="pyarrow",
                compute=_pool(concurrency), **resources).take_all()
            for row in done:
                statuses[row["status"]] += row["rows"]
        if merge:
            folder.merge(records, config.chunk_rows)
    finally:
        folder.release()
    return statuses


__all__ = ["GradspecScorer", "Parts", "score_dataset"]
