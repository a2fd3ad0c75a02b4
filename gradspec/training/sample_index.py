"""Each row's dataset index, carried from the data to the spectral monitor's ``sample_index`` column, so
that a monitor row can be mapped back to its sample.

The index travels as a column of the rows (``with_sample_index``), which a collator passes on as a batch
column (WITCollator does; any other collator through ``keep_sample_index``) and the monitor takes out
of the model call. Under Trainer the column needs ``remove_unused_columns=False``, else Trainer drops it
before the collator sees it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

SAMPLE_INDEX = "sample_index"


def with_sample_index(data: Any) -> Any:
    """The rows with each one's position in ``data`` as its ``sample_index`` (rows that have one keep theirs).

    Args:
        data: A list of dict rows, or a ``datasets.Dataset`` (a stream, ``IterableDataset``, is refused: its
            positions are not stable; give it an index column of its own).

    Returns:
        The same kind of rows (a new list or dataset; ``data`` is not changed).
    """
    if hasattr(data, "map") and hasattr(data, "column_names"):  # a datasets Dataset or IterableDataset
        if not hasattr(data, "__len__"):  # a stream's positions are not its rows' (shards, shuffles, workers)
            raise TypeError(f"{type(data).__name__}: a stream has no stable row positions; give its rows a "
                            f"{SAMPLE_INDEX} column of their own (an id from the data)")
        if SAMPLE_INDEX in data.column_names:
            return data
        return data.map(lambda row, i: {SAMPLE_INDEX: i}, with_indices=True)
    return [row if SAMPLE_INDEX in row else {**row, SAMPLE_INDEX: i} for i, row in enumerate(data)]


def sample_indices(rows: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """The batch's ``sample_index`` column (int64), or None where no row carries one.

    Raises:
        ValueError: Some rows carry one and others do not, or one is not an integer.
    """
    have = [SAMPLE_INDEX in row for row in rows]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"batch row {have.index(False)} has no {SAMPLE_INDEX} where others have one: give every "
                         "row its index (gradspec.training.with_sample_index) or none")
    values = [row[SAMPLE_INDEX] for row in rows]
    for i, value in enumerate(values):
        if isinstance(value, bool) or not hasattr(value, "__index__"):  # int, NumPy's and torch's integers
            raise ValueError(f"batch row {i}: {SAMPLE_INDEX} is {value!r}; expected an integer (the row's "
                             "dataset index)")
    return torch.tensor([operator.index(v) for v in values], dtype=torch.int64)


def keep_sample_index(collator: Callable[[list[dict]], Any]) -> Callable[[list[dict]], Any]:
    """A collator that passes the rows' ``sample_index`` on as a batch column around another collator
    (TRL's, transformers'), which gets the rows without it.

    Args:
        collator: The collator to wrap: rows -> a dict batch.

    Returns:
        The wrapping collator (picklable where ``collator`` is: DataLoader workers can take it).
    """
    return functools.partial(_collate_keeping_index, collator)


def _collate_keeping_index(collator: Callable[[list[dict]], Any], rows: list[dict]) -> Any:
    indices = sample_indices(rows)
    if indices is None:
        return collator(rows)
    batch = collator([{k: v for k, v in row.items() if k != SAMPLE_INDEX} for row in rows])
    if not isinstance(batch, MutableMapping):
        raise TypeError(f"keep_sample_index: the collator returned a {type(batch).__name__}; it takes a collator "
                        "that returns a dict batch (the model's keyword arguments)")
    batch[SAMPLE_INDEX] = indices
    return batch
