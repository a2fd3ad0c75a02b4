"""Device-to-host copies for the eigen stages that run on the host, into pinned host memory.

Pinned (page-locked) memory copies at full bus speed and asynchronously, so all of a batch's
copies are queued on a side stream and waited for, through events, by the thread that reads them.
The buffers come from torch's caching host allocator: pinning is slow (a system call, a page-table
walk), so it keeps freed blocks for reuse, and it hands a block out again only once the copies
recorded on it have landed. So a batch's host tensors are simply dropped after its eigen stage, even
one that failed before its copies were waited for. Its cache is unbounded and rounds each block up
to a power of two: the pinned memory a run holds is about two batches' copies per size class of
Gram, kept until the process ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's copy stream, one per process: copies there do not hold up the compute stream."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class HostCopies:
    """Queues copies of device tensors into pinned host tensors, on each device's side stream after
    the work queued so far on its compute stream (so the next batch's work does not queue behind
    them); ``queued`` records one event per device after them, ``wait`` blocks on those events alone,
    on whichever thread reads the host tensors (never on the compute stream)."""

    def __init__(self, pinned: Callable[[torch.Tensor], torch.Tensor] = _pinned_like) -> None:
        self.pinned = pinned
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.events: list[torch.cuda.Event] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t
        stream = self._stream(t.device)
        with torch.cuda.stream(stream):
            host = self.pinned(t)
            host.copy_(t, non_blocking=True)  # recorded on host's block: not handed out again before it lands
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
            event = torch.cuda.Event(blocking=True)  # its waiter sleeps: a spinning one would take a core from
            event.record(stream)  # the host's eigen stage
            self.events.append(event)
        self.streams = {}

    def wait(self) -> None:
        """Blocks until the queued copies have landed on the host."""
        self.queued()
        for event in self.events:
            event.synchronize()
        self.events = []


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
