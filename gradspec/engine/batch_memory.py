"""How much memory a batch of the engine takes, so that batches are sized to fit the device (or, on
the CPU, the host's available RAM) before they run; halving a batch that runs out stays the backstop.

A batch of N rows of T padded tokens holds, at its peak:

- what autograd keeps from the forward to the backward: measured once per engine, by running it on
  two probe batches under saved-tensor hooks (a T and a T^2 term: activations depend on the model,
  its attention implementation and its dtype, which no formula here could follow), times
  BACKWARD_FACTOR for the gradients alive during the backward;
- the scored inputs X that the hooks hold until their output gradients arrive;
- each sample's fp64 Grams: X X^T per input and D D^T per part (T x T), or, for a part whose smaller
  side is at most T, the Gram of G at that side; twice, as one batch's eigen stage runs while the
  next batch forms its own.

``BatchMemory.fits`` says whether a batch fits a budget: ``budget(device)``, HEADROOM of the memory
available when it is asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from gradspec.data.models import model_context
from gradspec.data.templates import IGNORE_INDEX
from gradspec.engine.capture import BatchCapture
from gradspec.linalg import stages

BACKWARD_FACTOR = 1.25  # peak over the saved activations during the backward (gradients of a layer)
HEADROOM = 0.7  # share of the available memory a batch may plan to use
PROBE_TOKENS = (32, 64)  # the probe batches' lengths (one row each)
GRAM_BYTES = 8  # fp64


@dataclass(frozen=True)
class BatchMemory:
    """Bytes of a batch, from the probes: per_token (saved activations and captured inputs per padded
    token), per_token_pair (per T^2 per row), and the Grams: per input, the smaller sides of its parts."""

    per_token: float
    per_token_pair: float
    inputs: tuple[tuple[int, ...], ...]

    def gram_elements(self, T: int) -> int:
        """fp64 elements of one sample's Grams at T tokens (the engine's split: T x T cores while T is
        below a part's smaller side, its materialised Gram after)."""
        total = 0
        for sides in self.inputs:
            total += T * T if T < max(sides) else 0  # X X^T, shared by the input's core parts
            total += sum(min(T, side) ** 2 for side in sides)
        return total

    def bytes(self, rows: int, T: int) -> float:
        """Planned peak bytes of a batch of rows x T padded tokens."""
        activations = rows * (self.per_token * T + self.per_token_pair * T * T) * BACKWARD_FACTOR
        return activations + 2 * rows * GRAM_BYTES * self.gram_elements(T)

    def fits(self, rows: int, T: int, budget: float) -> bool:
        """Whether such a batch fits in budget bytes (budget(device))."""
        return self.bytes(rows, T) <= budget


def budget(device: torch.device | str) -> float:
    """The bytes a batch may plan to use on device now: HEADROOM of what is available."""
    return HEADROOM * available_bytes(device)


def available_bytes(device: torch.device | str) -> int:
    """Memory a batch may use: on a GPU its free memory plus what torch's allocator holds unused; on
    the host the RAM the system reports available."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available


def measure(engine, pad_id: int) -> BatchMemory:
    """The engine's BatchMemory, from one-row probe batches of PROBE_TOKENS tokens (every token but
    the first a response token: the LM head's share is counted at every position, an over-estimate
    for prompts), or half and all of the model's context where that is shorter (no row is longer:
    models.fit_to_context). pad_id: a token the probes avoid (they hold no padding). The probes are
    given on the host: the engine moves them to the model's device."""
    t2 = min(PROBE_TOKENS[1], model_context(engine.model) or PROBE_TOKENS[1])
    t1 = min(PROBE_TOKENS[0], t2 // 2)
    with stages.DISPATCH.unmeasured():  # one-row probes must not choose the paths of real batches
        (s1, inputs), (s2, _) = (_probe(engine, T, pad_id) for T in (t1, t2))
    pair = max((s2 / t2 - s1 / t1) / (t2 - t1), 0.0)
    if engine.sketch is not None:  # lowrank: sketches, no Grams
        inputs = ()
    return BatchMemory(max(s1 / t1 - pair * t1, 0.0), pair, inputs)


def _probe(engine, T: int, pad_id: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(bytes kept from the forward to the backward of one row of T tokens: autograd's saved tensors
    other than parameters, and the inputs the hooks hold; each input's parts' smaller sides)."""
    parameters = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.device.type != "meta" and storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.arange(T) % 50 + 10
    ids[ids == pad_id] += 50
    ids = ids.view(1, T)
    labels = ids.clone()
    labels[:, 0] = IGNORE_INDEX
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        captures, _ = engine._forward_backward(ids, torch.ones_like(ids), labels)
    spectra = [c for c in captures if isinstance(c, BatchCapture)]
    shapes = list(spectra[0].inputs.values()) if spectra else []
    for capture in captures:  # the copies queued for the host are dropped unread (their blocks wait for them)
        capture.release()
    return sum(saved.values()) + T * sum(x for x, _ in shapes), tuple(tuple(sides) for _, sides in shapes)
