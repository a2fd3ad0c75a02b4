"""Device-to-host copies for the eigen stages that run on the host, into a bounded pool of pinned buffers.

Pinned (page-locked) memory copies at full bus speed and asynchronously, so all of a batch's
copies are queued before one wait. Pinning is slow (a system call, a page-table walk), so
buffers are reused across batches rather than allocated per Gram; the pool holds at most
``max_bytes`` (two batches in flight need about two batches' Grams). Past the bound a copy goes
to ordinary memory (slower, still correct), logged once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

log = logging.getLogger("gradspec")
MAX_PINNED_BYTES = int(os.environ.get("GRADSPEC_PINNED_BYTES", 4 << 30))


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Byte buffers by size class (powers of two), taken for a batch and given back after it."""

    def __init__(self, max_bytes: int = MAX_PINNED_BYTES, allocate: Callable[[int], torch.Tensor] = _pinned) -> None:
        self.max_bytes, self.allocate = max_bytes, allocate
        self.free: dict[int, list[torch.Tensor]] = {}
        self.held = 0  # bytes allocated by the pool, free or taken
        self.warned = False
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least nbytes, or None when the pool is at its bound."""
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            if self.free.get(size):
                return self.free[size].pop()
            if self.held + size > self.max_bytes:
                if not self.warned:
                    log.warning("pinned host buffers at their bound (%d MiB): copying through pageable memory",
                                self.max_bytes >> 20)
                    self.warned = True
                return None
            self.held += size
        return self.allocate(size)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for b in buffers:
                self.free.setdefault(b.numel(), []).append(b)


POOL = PinnedPool()


class HostCopies:
    """Queues copies of device tensors into pooled pinned buffers; ``wait`` once for all of them,
    ``release`` when the host tensors are no longer read."""

    def __init__(self, pool: PinnedPool = POOL) -> None:
        self.pool = pool
        self.devices: set[torch.device] = set()
        self.buffers: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t
        nbytes = t.numel() * t.element_size()
        buffer = self.pool.take(nbytes)
        if buffer is None:
            return t.cpu()
        self.buffers.append(buffer)
        host = buffer[:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        self.devices.add(t.device)
        return host

    def wait(self) -> None:
        for device in self.devices:
            torch.cuda.current_stream(device).synchronize()

    def release(self) -> None:
        self.pool.give_back(self.buffers)
        self.buffers = []
