"""Device-to-host copies for the eigen stages that run on the host, into a bounded pool of pinned buffers.

Pinned (page-locked) memory copies at full bus speed and asynchronously, so all of a batch's
copies are queued on a side stream and waited for, through events, by the thread that reads them.
Pinning is slow (a system call, a page-table walk), so buffers are reused across batches rather
than allocated per Gram; the pool holds at most ``max_bytes``, grown to two batches' copies (two
batches are in flight) up to PINNED_SHARE of the host's RAM. Past the bound a copy goes to a
buffer torch pins for it (slower), logged once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psutil
import torch

log = logging.getLogger("gradspec")
MAX_PINNED_BYTES = int(os.environ.get("GRADSPEC_PINNED_BYTES", 4 << 30))
PINNED_SHARE = 0.25  # of the host's RAM, the most the pool grows to for large batches


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

    def fit(self, batch_bytes: int) -> None:
        """Room for two batches of batch_bytes of copies, within PINNED_SHARE of the host's RAM."""
        most = int(PINNED_SHARE * psutil.virtual_memory().total)
        with self._lock:
            self.max_bytes = max(self.max_bytes, min(2 * batch_bytes, most))

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for b in buffers:
                self.free.setdefault(b.numel(), []).append(b)


POOL = PinnedPool()


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's copy stream, one per process: copies there do not hold up the compute stream."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class HostCopies:
    """Queues copies of device tensors into pooled pinned buffers, on each device's side stream after
    the work queued so far on its compute stream (so the next batch's work does not queue behind
    them); ``queued`` records one event per device after them, ``wait`` blocks on those events alone,
    on whichever thread reads the host tensors (never on the compute stream); ``release`` when the
    host tensors are no longer read."""

    def __init__(self, pool: PinnedPool = POOL) -> None:
        self.pool = pool
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.events: list[torch.cuda.Event] = []
        self.buffers: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t
        stream = self._stream(t.device)
        nbytes = t.numel() * t.element_size()
        buffer = self.pool.take(nbytes)
        with torch.cuda.stream(stream):
            if buffer is None:  # past the pool's bound: torch pins a new buffer
                host = t.to("cpu", non_blocking=True)
            else:
                self.buffers.append(buffer)
                host = buffer[:nbytes].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory is not reused before the copy has read it
        return host

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            stream = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self.streams[device] = stream
        return self.streams[device]

    def queued(self) -> None:
        """Every copy so far is queued: record the events wait blocks on."""
        for stream in self.streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            self.events.append(event)
        self.streams = {}

    def wait(self) -> None:
        """Blocks until the queued copies have landed on the host."""
        self.queued()
        for event in self.events:
            event.synchronize()
        self.events = []

    def release(self) -> None:
        self.pool.give_back(self.buffers)
        self.buffers = []


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on device without the host waiting for the device: a copy from pageable memory
    may wait for the stream, so it is pinned first (torch's caching host allocator keeps the pinned
    block until the copy has read it)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
