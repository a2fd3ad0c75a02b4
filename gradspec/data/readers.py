"""Reading SFT samples: an input's records (gradspec.data.formats) through a row layout
(gradspec.data.row_layouts) into Samples, a bad row raised or kept as the row's error; the built-in
HumanEval (gradspec.data.humaneval) where no input is given. Errors are raised lazily, so rows scored
before them are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from gradspec.data.errors import InputError
from gradspec.data.formats import check_readable, count_records, open_parquet, read_json, read_records
from gradspec.data.hub import Hub
from gradspec.data.humaneval import HUMANEVAL_SIZE, humaneval_samples
from gradspec.data.row_layouts import Fields, to_sample
from gradspec.data.sample import Sample

__all__ = [  # what other modules read samples with
    "HUMANEVAL_SIZE", "ON_ERROR", "Fields", "Hub", "InputError", "RowError", "Sample", "SampleStream", "check_readable",
    "count_records", "data_samples", "humaneval_samples", "open_parquet", "read_json", "read_samples", "to_sample",
]

ON_ERROR = ("fail", "skip")  # what a malformed row does: stop the run, or skip and report the row


class RowError(InputError):
    """A malformed row read with on_error="fail"; index: its 0-based position in the input (so a
    caller knows which rows before it are whole)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self):
        return type(self), (str(self), self.index)


def read_samples(
    path: str | Path, fields: Fields = Fields(), limit: int | None = None,
    wanted: Callable[[int], bool] | None = None, on_error: str = "fail", hub: Hub = Hub(),
    ended: Callable[[int], None] | None = None,
) -> Iterator[Sample]:
    """Samples in input order, index = 0-based position in the input; only those wanted.

    A bad row raises InputError (on_error="fail") or becomes a Sample whose error says what
    is wrong and where (on_error="skip"). ended(n): called with the input's rows when it ends
    before the limit (a stream whose size nothing said).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    index = -1
    for index, (where, record) in enumerate(read_records(path, wanted, hub)):
        if limit is not None and index >= limit:
            return
        if record is None or (wanted is not None and not wanted(index)):
            continue
        try:
            if isinstance(record, InputError):
                raise record
            sample = to_sample(index, where, record, fields)
        except InputError as e:
            if on_error == "fail":
                raise RowError(str(e), index) from None
            sample = Sample(index, [], error=str(e))
        yield sample
    if ended is not None and limit is not None and index + 1 < limit:
        ended(index + 1)


def data_samples(
    path: str | Path | None, fields: Fields = Fields(), limit: int | None = None,
    wanted: Callable[[int], bool] | None = None, on_error: str = "fail", hub: Hub = Hub(),
    ended: Callable[[int], None] | None = None,
) -> Iterator[Sample]:
    """``read_samples`` of path, or of the built-in HumanEval where no path is given."""
    if path is not None:
        return read_samples(path, fields, limit, wanted, on_error, hub, ended)
    return (s for s in humaneval_samples(limit) if wanted is None or wanted(s.index))


class SampleStream(Iterator[Sample]):
    """The samples a process scores (an iterator), and the input they come from: head(n) reads the
    input's first n rows (up to the limit) whoever scores them, a malformed one as a Sample whose
    error says why (never raised). Every process of a run reads the same head."""

    def __init__(self, samples: Iterator[Sample], head: Callable[[int], Iterator[Sample]]) -> None:
        self._samples, self._head = samples, head

    def __next__(self) -> Sample:
        return next(self._samples)

    def head(self, n: int) -> list[Sample]:
        return list(self._head(n))
