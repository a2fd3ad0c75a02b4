"""Pick the fastest of interchangeable implementations by timing them on the real work.

Which path wins depends on the device, the library versions and the shape (a GPU's
batched eigensolver against the host's LAPACK threads; a Triton kernel against cuBLAS), so it
is measured where it runs, once per shape bucket, instead of read from a table measured on
another machine. The first call for a key runs every candidate twice (a warm-up that pays for
compilation and workspaces, then the timed run) and returns the winner's result, so no work
is thrown away; later calls run the winner alone. A candidate that raises is logged and left
out (a kernel that does not compile on this GPU must not stop a run), for a while: after
``RETRY_AFTER`` more batches (``tick``, once per batch) the key is measured again, every candidate
included, so a transient failure (an out-of-memory beside another batch) does not ban a path for
good; from then on ``choice`` is open again, so the engine keeps that batch's Grams where every path
can run, and measures on its own thread. A timing shared with other work on the device or the host
cores would be off, so measurements hold ``lock``, and so does code that runs such work beside them
(the engine's eigen worker). A candidate whose warm-up alone takes more than ``LOSING_WARM_UP``
times the best timed run so far, and over ``MIN_LOSING_S`` (far above a kernel's compilation), is
not run again: it has lost, and on a lent GPU its second run would cost minutes. Work that must not
decide a choice (the memory probes' one-row batches: a choice holds for every batch size of its
key) runs ``unmeasured``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("gradspec")
RETRY_AFTER = 16  # batches before a key with a candidate that failed in its measurement is measured again
LOSING_WARM_UP = 4.0  # a warm-up this many times the best timed run (and over MIN_LOSING_S) ends a candidate
MIN_LOSING_S = 20.0


def size_bucket(n: int) -> int:
    """n rounded up to a power of two: shapes within a factor of two share one measurement."""
    return 1 << max(int(n) - 1, 0).bit_length()


class MeasuredDispatch:
    """Per key, the name of the fastest candidate, measured on first use."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.chosen: dict[Hashable, str] = {}
        self.seconds: dict[Hashable, dict[str, float]] = {}  # the measurements, for reports
        self.retry_in: dict[Hashable, int] = {}  # batches left before a key with a failed candidate is re-measured
        self.lock = threading.RLock()
        self._unmeasured = 0

    @contextmanager
    def unmeasured(self) -> Iterator[None]:
        """Meanwhile a key still to be measured runs its first candidate and stays open. Process-wide, not
        per thread: on a GPU, autograd runs the backward's hooks on its own device thread."""
        with self.lock:
            self._unmeasured += 1
        try:
            yield
        finally:
            with self.lock:
                self._unmeasured -= 1

    def tick(self) -> None:
        """One more batch: brings every key with a failed candidate a batch closer to its re-measurement."""
        with self.lock:
            for key in self.retry_in:
                self.retry_in[key] -= 1

    def choice(self, key: Hashable) -> str | None:
        """The measured winner for key, or None while it is still to be measured, or measured again
        (a candidate failed RETRY_AFTER batches ago)."""
        return None if self.retry_in.get(key, 1) <= 0 else self.chosen.get(key)

    def run(self, key: Hashable, candidates: dict[str, Callable[[], T]], sync: Callable[[], None] = lambda: None) -> T:
        """The result of the fastest candidate for key; `sync` waits for queued device work, so
        each timing covers its own candidate only."""
        name = self.choice(key)
        if name is None:
            if self._unmeasured:
                return next(iter(candidates.values()))()
            with self.lock:
                name = self.choice(key)  # another thread may have measured it meanwhile
                if name is None:
                    return self._measure(key, candidates, sync)
        return candidates[name]()

    def _measure(self, key: Hashable, candidates: dict[str, Callable[[], T]], sync: Callable[[], None]) -> T:
        results: dict[str, T] = {}
        seconds: dict[str, float] = {}
        failed: list[Exception] = []
        for name, candidate in candidates.items():
            try:
                sync()
                start = self.clock()
                candidate()
                sync()
                warm_up = self.clock() - start
                if results and warm_up > max(LOSING_WARM_UP * min(seconds[n] for n in results), MIN_LOSING_S):
                    seconds[name] = warm_up  # lost already: not run again
                    continue
                start = self.clock()
                results[name] = candidate()
                sync()
            except Exception as error:  # a path that fails on this machine is no candidate here
                log.warning("%s path failed for %s, not used: %s: %s", name, key, type(error).__name__, error)
                seconds[name] = math.inf
                failed.append(error)
                continue
            seconds[name] = self.clock() - start
        if not results:
            raise failed[-1]
        best = min(results, key=seconds.__getitem__)
        self.chosen[key], self.seconds[key] = best, seconds
        if failed:
            self.retry_in[key] = RETRY_AFTER
        else:
            self.retry_in.pop(key, None)
        return results[best]
