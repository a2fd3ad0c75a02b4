"""The passes over a task's or a factor fit's batches, which run before a scoring run's bar starts and
can take minutes: each example numbered, and a bar by examples where asked."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from tqdm import tqdm


def numbered(batches: Sequence[tuple[torch.Tensor, ...]], desc: str | None = None,
             progress: bool = False) -> Iterator[tuple[list[int], tuple[torch.Tensor, ...]]]:
    """(example numbers, batch) for each batch: example j is the j-th row over all batches. progress: a bar
    named desc, by examples, on stderr."""
    with tqdm(total=sum(len(b[0]) for b in batches), desc=desc, unit="example", disable=not progress,
              dynamic_ncols=True) as bar:
        start = 0
        for batch in batches:
            yield list(range(start, start + len(batch[0]))), batch
            start += len(batch[0])
            bar.update(len(batch[0]))
