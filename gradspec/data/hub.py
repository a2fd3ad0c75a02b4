"""Datasets that the `datasets` library reads: a Hub name (``org/name``), a folder that
``datasets.load_dataset`` reads (data files, or a Hub repository's layout with its README
configs), or a ``save_to_disk`` folder. A split is read in order; streamed, as it downloads.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gradspec.data.errors import InputError, OptionInputError
from gradspec.options import check_options, mention, option

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # the Hub's repository ids (datasets and models)
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")
_ROWS_PER_READ = 1024
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@dataclass(frozen=True)
class Hub:
    """Which part of such a dataset to read.

    Args:
        split: the split (load_dataset's ``split``).
        name: the dataset's configuration (load_dataset's ``name``).
        streaming: stream the rows instead of downloading the dataset first.
    """

    split: str = option("train", "the split to read of data read through datasets (a Hub name or a folder)")
    name: str | None = option(None, "the configuration of data read through datasets", kind="str?",
                              name="config_name")
    streaming: bool = option(False, "stream data read through datasets instead of downloading it first",
                             kind="bool")

    def __post_init__(self) -> None:
        check_options(self)


def is_dataset_name(data: str) -> bool:
    """Whether data, which is not a local path, reads as a Hub dataset name."""
    return not Path(data).exists() and bool(HUB_ID.match(data)) and not data.endswith(_FILE_SUFFIXES)


def _saved(path: Path) -> bool:
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


_opened: dict[tuple[str, Hub], Any] | None = None  # inside loaded_once: the datasets loaded so far


@contextmanager
def loaded_once() -> Iterator[None]:
    """Within it, each dataset is loaded once: a run reads its size, its first row and its rows,
    and each load of a Hub name asks the Hub again. (Also a decorator.)"""
    global _opened
    outer = _opened
    _opened = {} if outer is None else outer
    try:
        yield
    finally:
        _opened = outer


def load(data: str, hub: Hub = Hub()) -> Any:
    """The split as a ``datasets.Dataset`` (an ``IterableDataset`` when streaming)."""
    if _opened is None:
        return _load(data, hub)
    if (data, hub) not in _opened:
        _opened[data, hub] = _load(data, hub)
    return _opened[data, hub]


def _load(data: str, hub: Hub) -> Any:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{data}: reading it needs the datasets library: pip install datasets") from None
    path = Path(data)
    if path.is_dir() and _saved(path):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if hub.split not in ds:
                raise OptionInputError((), f"{data}: no split {hub.split!r} ({mention('split')}); splits: {list(ds)}")
            ds = ds[hub.split]
        return ds.to_iterable_dataset() if hub.streaming else ds
    offline = not path.is_dir() and not hub_reachable()
    try:
        with _offline() if offline else nullcontext():
            return datasets.load_dataset(data, hub.name, split=hub.split, streaming=hub.streaming)
    except (ValueError, OSError) as e:  # unknown split or config, no such dataset, no network
        where = "folder" if path.is_dir() else "Hub dataset"
        why = "; the Hub is not reachable from this machine: only datasets in the local cache load offline" * offline
        raise InputError(f"{data}: datasets.load_dataset cannot read this {where} "
                         f"(split {hub.split!r}, config {hub.name!r}): {e}{why}") from None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host takes a connection: without one, the Hub library retries for half a
    minute before it fails. Behind a proxy (or when offline mode is already on) it is not probed."""
    import huggingface_hub.constants as hub_constants

    if hub_constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in _PROXIES):
        return True
    url = urlparse(hub_constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


@contextmanager
def _offline() -> Iterator[None]:
    """The Hub libraries' offline mode (HF_HUB_OFFLINE=1, read at their import) for one load: the
    local cache is read, the network is not tried."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def size(data: str, hub: Hub = Hub()) -> int:
    """Rows in the split; a streamed one's size as its metadata gives it."""
    ds = load(data, hub)
    if not hub.streaming:
        return len(ds)
    splits = ds.info.splits or {}
    if hub.split in splits and splits[hub.split].num_examples:
        return splits[hub.split].num_examples
    raise OptionInputError((), f"{data}: streaming, and the dataset does not say how many rows split {hub.split!r} "
                           f"has: pass {mention('limit')} N (or leave out {mention('streaming')})")


def records(data: str, hub: Hub = Hub(), wanted: Callable[[int], bool] | None = None
            ) -> Iterator[tuple[str, dict | None]]:
    """(location, record) per row of the split, None for rows that wanted(index) rejects."""
    where = f"{data} [{hub.split}] row"
    yield from dataset_records(load(data, hub), lambda row: f"{where} {row}", wanted, hub.streaming)


def dataset_records(ds: Any, locate: Callable[[int], str], wanted: Callable[[int], bool] | None = None,
                    streaming: bool = False) -> Iterator[tuple[str, dict | None]]:
    """(locate(index), record) per row of a loaded split: a ``datasets.Dataset`` read in batches (only those
    holding a wanted row), or an ``IterableDataset`` (streaming) as it comes; None for rows that wanted
    rejects."""
    if streaming:
        for row, record in enumerate(ds):
            yield locate(row), record if wanted is None or wanted(row) else None
        return
    for start in range(0, len(ds), _ROWS_PER_READ):
        rows = range(start, min(start + _ROWS_PER_READ, len(ds)))
        keep = [wanted is None or wanted(i) for i in rows]
        batch = ds[rows.start : rows.stop] if any(keep) else {}
        for k, (i, kept) in enumerate(zip(rows, keep, strict=True)):
            yield locate(i), {c: v[k] for c, v in batch.items()} if kept else None
