"""Scoring a dataset chunk by chunk: read in order, bucket by length, batch under a token budget, write in order."""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import chain, groupby, islice
from typing import Any

import torch
from tqdm import tqdm

from gradspec.choices import CHUNK_ROWS, MAX_LENGTH
from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, pad_id_of, token_batches
from gradspec.data.carried_columns import mixed_columns, with_text_columns
from gradspec.data.errors import InputError
from gradspec.data.models import input_device
from gradspec.data.readers import Sample, SampleStream
from gradspec.data.templates import RESPONSE_CHECK_ROWS, check_response_tokens, tokenize
from gradspec.engine import batch_memory
from gradspec.engine.batch_memory import BatchMemory
from gradspec.engine.spectral_engine import BatchScores, SpectralEngine
from gradspec.runs.rows import add_classic, collect, skipped_row, unscored_row, with_every_column

log = logging.getLogger("gradspec")


def submit_with_split(
    engine: SpectralEngine, batch: list[Item], pad_id: int
) -> list[tuple[Item, Future[BatchScores] | None, int]]:
    """(item, future scores, row in them) for each item. Out of memory: split the batch in half
    and retry each half; a single sample that still does not fit gets None (flagged by the caller)."""
    try:
        result = engine.submit(*pad_batch([b.tokens for b in batch], pad_id, "cpu"))  # the engine moves it
        return [(item, result, k) for k, item in enumerate(batch)]
    except torch.OutOfMemoryError:
        if engine.lockstep is not None:  # the peers wait in this pass's collectives: no rank retries alone
            log.error("out of memory in a pass under --fsdp (a batch of %d, %d tokens): lower --batch-tokens",
                      len(batch), sum(b.tokens.num_tokens for b in batch))
            raise
        # retried below, not here: the failed pass's frames (its graph, its Grams) live as long as this block
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if len(batch) == 1:
        log.warning("sample %d does not fit in memory (%d tokens); flagged out_of_memory",
                    batch[0].sample.index, batch[0].tokens.num_tokens)
        return [(batch[0], None, 0)]
    log.warning("out of memory on a batch of %d; retrying it in two halves", len(batch))
    half = len(batch) // 2
    return submit_with_split(engine, batch[:half], pad_id) + submit_with_split(engine, batch[half:], pad_id)


class _Progress:
    """A progress bar with samples/s, tokens/s and the ETA."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="sample", disable=not enabled, dynamic_ncols=True)
        self.start, self.tokens = time.perf_counter(), 0

    def advance(self, samples: int, tokens: int = 0) -> None:
        self.tokens += tokens
        self.bar.update(samples)
        if self.tokens:  # before the first batch is done there is no rate to show (not tok_s=0 for minutes)
            self.bar.set_postfix(tok_s=f"{self.tokens / (time.perf_counter() - self.start):.0f}", refresh=False)


@dataclass(frozen=True)
class Flush:
    """Where the rows of an unfinished chunk go every so often, and come back from after a kill: a kill costs
    at most ``seconds`` of scoring, not a chunk's. A resumed chunk scores only the rows it lacks, in the
    same batches (its rows are batched by length, and those written were its first batches)."""

    seconds: float
    write: Callable[[int, list[dict[str, Any]]], None]  # (chunk, its rows scored so far)
    rows: Callable[[int], list[dict[str, Any]]]  # chunk -> the rows a killed run wrote of it


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
                _MEASURED[self.engine] = batch_memory.measure(self.engine, self.pad_id)
            self.memory = _MEASURED[self.engine]
            self.budget = batch_memory.budget(device)
            log.info("batches planned within %.1f GiB: %.0f KiB per token, Grams of %d inputs",
                     self.budget / 2**30, self.memory.per_token / 2**10, len(self.memory.inputs))
        return self.memory.fits(rows, longest, self.budget)

    def refuses(self, item: Item) -> bool:
        """Whether a sample alone cannot fit the host's RAM (said with its estimate): it is flagged, never
        run, as a pass past the RAM is not an error to catch there (the kernel kills the process). On a GPU
        it is tried: an out-of-memory error is caught and flagged (submit_with_split)."""
        if self.fits(1, item.tokens.num_tokens) or input_device(self.engine.model).type != "cpu":
            return False
        log.warning("sample %d (%d tokens) needs about %.1f GiB (its activations, Grams and eigen stage), beyond "
                    "the %.1f GiB this run may use (%d%% of the memory available); flagged out_of_memory, not run%s",
                    item.sample.index, item.tokens.num_tokens, self.memory.bytes(1, item.tokens.num_tokens) / 2**30,
                    self.budget / 2**30, round(batch_memory.HEADROOM * 100), self._way_out(item.tokens.num_tokens))
        return True

    def _way_out(self, tokens: int) -> str:
        """The --max-length at which a sample this long would fit (its tokens cut there, flagged truncated)."""
        low, high = 0, tokens  # fits(low); not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.memory.fits(1, middle, self.budget) else (low, middle)
        return f" (--max-length {low} or less would fit it, cut there and flagged truncated)" if low > 0 else ""


def _score_chunk(samples: list[Sample], engine: SpectralEngine, tokenizer, template: str, max_length: int,
                 batch_tokens: int, progress: _Progress, plan: _BatchPlan | None = None,
                 flush: Flush | None = None, chunk: int = 0) -> list[dict[str, Any]]:
    """Output rows of consecutive samples, in their order; batches within are sorted by length
    (and sized to fit memory by plan); with flush, the rows scored so far written every flush.seconds and
    when the chunk is stopped (Ctrl-C, SIGTERM, an error), and those a stopped run wrote taken back (its
    spectra: the classic scores are run on the whole chunk)."""
    pad_id = pad_id_of(tokenizer)
    items = [Item(s, tokenize(s.messages, tokenizer, template, max_length)) for s in samples if s.error is None]
    rows = {item.sample.index: unscored_row(item) for item in items}
    rows.update({s.index: skipped_row(s) for s in samples if s.error is not None})
    earlier = {row["index"]: row for row in ([] if flush is None else flush.rows(chunk)) if row["index"] in rows}
    rows.update(earlier)
    finished = list(earlier)  # the rows scored (their batches collected), in the order they were
    if earlier:
        log.warning("chunk %d: %d rows scored before the run stopped, taken back", chunk, len(earlier))
        progress.advance(len(earlier), sum(row["num_tokens"] for row in earlier.values()))
    scorable = [i for i in items if i.tokens.scorable]
    # One batch in flight: on a GPU its eigen stage runs while the next batch's forward and backward
    # do (SpectralEngine.overlap); on the CPU submit has finished it.
    pending: list[tuple[Item, Future[BatchScores] | None, int]] = []
    flushed = time.monotonic()
    try:
        for batch in token_batches([i for i in scorable if i.sample.index not in earlier], batch_tokens,
                                   fits=None if plan is None else plan.fits):
            too_big = plan is not None and len(batch) == 1 and plan.refuses(batch[0])
            submitted = [(batch[0], None, 0)] if too_big else submit_with_split(engine, batch, pad_id)
            progress.advance(len(pending), collect(pending, rows, engine.metric_names))
            finished += [item.sample.index for item, _, _ in pending]
            pending = submitted
            if flush is not None and time.monotonic() - flushed >= flush.seconds and finished:
                flush.write(chunk, [rows[i] for i in finished])
                flushed = time.monotonic()
    except BaseException:  # Ctrl-C, SIGTERM, a failure: the rows scored so far kept, as a flush keeps them
        if flush is not None:
            _keep(flush, chunk, rows, finished, pending, engine)
        raise
    progress.advance(len(pending), collect(pending, rows, engine.metric_names))
    if engine.token_stats:
        add_classic(engine, tokenizer, scorable, rows, max_length, batch_tokens)
    progress.advance(len(samples) - len(scorable))
    return [with_every_column(rows[s.index], engine) for s in samples]


def _keep(flush: Flush, chunk: int, rows: dict[int, dict[str, Any]], finished: list[int],
          pending: list[tuple[Item, Future[BatchScores] | None, int]], engine: SpectralEngine) -> None:
    """An unfinished chunk's rows scored before the run stopped, written as a flush writes them (the batch
    scored but not collected yet among them, where its scores are ready: never waited for); a write that
    fails is logged, the stop's own error goes on."""
    if all(future is None or future.done() for _, future, _ in pending):
        try:
            collect(pending, rows, engine.metric_names)
            finished = finished + [item.sample.index for item, _, _ in pending]
        except Exception:  # noqa: BLE001  (its scores failed: it is scored again)
            pass
    if not finished:
        return
    try:
        flush.write(chunk, [rows[i] for i in finished])
    except Exception as error:  # noqa: BLE001  (the stop's own error is what the user must see)
        log.warning("chunk %d: the %d rows scored before the run stopped not kept (%s)", chunk, len(finished), error)
    else:
        log.warning("chunk %d: the %d rows scored before the run stopped kept; the same command with --resume "
                    "scores the others", chunk, len(finished))


def score_samples(
    samples: Iterable[Sample], engine: SpectralEngine, tokenizer, write: Callable[[int, list[dict[str, Any]]], None],
    chunk_rows: int = CHUNK_ROWS, template: str = "plain", max_length: int = MAX_LENGTH,
    batch_tokens: int = BATCH_TOKENS, progress: bool = True, total: int | None = None, flush: Flush | None = None,
) -> Counter[str]:
    """Scores samples chunk by chunk (chunk = index // chunk_rows); write(chunk, rows) gets each
    chunk's rows in input order (and flush, where given, an unfinished chunk's rows every so often).
    Returns how many rows got each status.

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
            rows = _score_chunk(chunk_samples, engine, tokenizer, template, max_length, batch_tokens, bar, plan,
                                flush, chunk)
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
