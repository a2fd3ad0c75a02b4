"""Pick the faster of interchangeable implementations by timing them on the real work.

Which of two paths wins depends on the device, the library versions and the shape (a GPU's
batched eigensolver against the host's LAPACK threads; a Triton kernel against cuBLAS), so it
is measured where it runs, once per shape bucket, instead of read from a table measured on
another machine. The first call for a key runs every candidate twice (a warm-up that pays for
compilation and workspaces, then the timed run) and returns the winner's result, so no work
is thrown away; later calls run the winner alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def size_bucket(n: int) -> int:
    """n rounded up to a power of two: shapes within a factor of two share one measurement."""
    return 1 << max(int(n) - 1, 0).bit_length()


class Fastest:
    """Per key, the name of the fastest candidate, measured on first use."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.chosen: dict[Hashable, str] = {}
        self.seconds: dict[Hashable, dict[str, float]] = {}  # the measurements, for reports
        self._lock = threading.Lock()

    def choice(self, key: Hashable) -> str | None:
        """The measured winner for key, or None while it has not been measured."""
        return self.chosen.get(key)

    def run(self, key: Hashable, candidates: dict[str, Callable[[], T]], sync: Callable[[], None] = lambda: None) -> T:
        """The result of the fastest candidate for key; `sync` waits for queued device work, so
        each timing covers its own candidate only."""
        name = self.chosen.get(key)
        if name is not None:
            return candidates[name]()
        results: dict[str, T] = {}
        seconds: dict[str, float] = {}
        for name, candidate in candidates.items():
            candidate()
            sync()
            start = self.clock()
            results[name] = candidate()
            sync()
            seconds[name] = self.clock() - start
        best = min(seconds, key=seconds.__getitem__)
        with self._lock:
            self.chosen.setdefault(key, best)
            self.seconds[key] = seconds
        return results[self.chosen[key]]
