"""Capture under activation checkpointing, without holding what checkpointing frees.

A checkpointed region's forward runs twice: once in the forward pass, again inside the backward
to recompute what it freed. The gradient D of a module's output comes from the first run's graph
(non-reentrant checkpointing, transformers' default) or from the second's (re-entrant: the first
runs without grad). Its input X is then taken from the recomputed run, which happens just before
the region's backward, so only one region's inputs are held at a time, as checkpointing intends.

``phase()`` tells a hook which run it is in, from the saved-tensor hooks torch's non-reentrant
checkpoint installs (``_checkpoint_hook`` in the first run, ``_recomputation_hook`` in the
second); a re-entrant recompute is an ordinary forward with its own backward. ``Pairing`` matches
a first-run call's D with its recomputed X by (region, call number), whichever arrives first.
Where torch's frames cannot be read (another torch), ``phase`` raises rather than guess.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

PLAIN, FIRST, RECOMPUTE = "plain", "checkpointed", "recompute"


class Phase(NamedTuple):
    kind: str  # PLAIN, FIRST (a checkpointed forward that will be recomputed) or RECOMPUTE
    frame: object | None  # the checkpointed region (torch's _CheckpointFrame)


def phase() -> Phase:
    """Which run of a checkpointed region (if any) the current forward is."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return Phase(PLAIN, None)
    pack = top[0]
    kind = {"_checkpoint_hook": FIRST, "_recomputation_hook": RECOMPUTE}.get(pack.__qualname__.split(".")[0])
    if kind is None:  # another saved-tensor hook (save_on_cpu, ...): no region of ours
        return Phase(PLAIN, None)
    frame = _frame_of(pack)
    if frame is None:
        raise RuntimeError(f"gradspec cannot find the region of torch {torch.__version__}'s checkpoint "
                           f"({pack.__qualname__}): capture under activation checkpointing is unsupported here")
    return Phase(kind, frame)


def _frame_of(pack: Callable) -> object | None:
    """The _CheckpointFrame a checkpoint pack hook closes over (itself or through a weak reference;
    the recompute's hook is wrapped by torch._dynamo.disable)."""
    pack = inspect.unwrap(pack)
    for cell in pack.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, weakref.ref):
            value = value()
        if type(value).__name__ == "_CheckpointFrame":
            return value
    return None


class Pairing:
    """One target's first-run output gradients and recomputed inputs, matched by (region, n-th
    call of the target in it): the recompute repeats the region's calls in order. Whichever of X
    and D comes second completes the pair and hands both to `done`."""

    def __init__(self) -> None:
        self._regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _region(self, frame: object) -> dict:
        return self._regions.setdefault(frame, {"first": 0, "recompute": 0, "waiting": {}})

    def expect(self, frame: object) -> tuple[object, int]:
        """A first-run call: its key, for the D that its output's gradient will bring."""
        region = self._region(frame)
        region["first"] += 1
        return frame, region["first"] - 1

    def recomputed(self, frame: object, X: torch.Tensor, done: Callable) -> None:
        region = self._region(frame)
        region["recompute"] += 1
        self._meet(region, region["recompute"] - 1, "X", X, done)

    def gradient(self, key: tuple[object, int], D: torch.Tensor, done: Callable) -> None:
        frame, n = key
        self._meet(self._region(frame), n, "D", D, done)

    @staticmethod
    def _meet(region: dict, n: int, which: str, value: torch.Tensor, done: Callable) -> None:
        other = region["waiting"].pop(n, None)
        if other is None:
            region["waiting"][n] = (which, value)
            return
        X, D = (value, other[1]) if which == "X" else (other[1], value)
        done(X, D)
