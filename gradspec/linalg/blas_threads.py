"""SciPy's BLAS held at one thread while any gradspec extension call runs, and restored after.

The extension spreads its work over the batch on its own threads; BLAS threads inside each task
would oversubscribe the cores (measured 4x slower on 2 cores). OpenBLAS's thread count is
process-wide, and both the hooks (main thread) and the eigen worker call the extension, so
the limit is reference-counted: the first caller to enter sets it, the last to leave restores
the count it found. Separate save/restore per call would interleave across the two threads and
could leave the user's BLAS at the wrong count. (MKL's count the extension sets per thread, on
its own threads, and puts back: csrc/spectral.cpp, parallel_for.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class OneBlasThread:
    """A re-entrant, thread-safe ``with`` block that holds BLAS at one thread."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller  # threadpoolctl.ThreadpoolController, or None: nothing to limit
        self._lock = threading.Lock()
        self._inside = 0
        self._limiter: Any = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0 and self._controller is not None:
                self._limiter = self._controller.limit(limits=1, user_api="blas")
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0 and self._limiter is not None:
                    self._limiter.restore_original_limits()
                    self._limiter = None
