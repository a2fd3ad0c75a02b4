"""Which path runs a stage (gradspec.linalg.policy.STAGES), and running it.

The policy's forced path, else the only one, else on the CPU the first of a fixed preference
(the extension wins at every size there: benchmarks/throughput/bench_eigen.py; a fixed path keeps reruns
bit-identical), else on a GPU the path measured fastest for this (stage, precision, size bucket)
on the first batch that needs it. Every path of a stage gives the same numbers at one precision.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

from gradspec import kernels
from gradspec.linalg import extension, solvers
from gradspec.linalg.dispatch import MeasuredDispatch
from gradspec.linalg.policy import Policy

T = TypeVar("T")

DISPATCH = MeasuredDispatch()
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def on_gpu(t: torch.Tensor) -> bool:
    """Whether paths are measured against each other for t: on a GPU."""
    return t.is_cuda


def _sync(t: torch.Tensor) -> Callable[[], None]:
    return partial(torch.cuda.synchronize, t.device) if t.is_cuda else (lambda: None)


def _triton_here(t: torch.Tensor) -> bool:
    return kernels.triton is not None and (t.is_cuda or TRITON_INTERPRETED)


def _always(t: torch.Tensor, fp64: bool) -> bool:
    return True


# Each stage's paths, preferred first, and whether a path exists for a tensor t at a precision (fp64:
# the policy's is fp64). Triton's segment Gram is the fp32 kernel, or at fp64 the segment SYRK.
_EIGEN_PATHS = (
    ("cpp", lambda t, fp64: extension.BUILT),
    ("torch", _always),
    ("cupy", lambda t, fp64: on_gpu(t) and solvers.cupy_eigen() is not None),
    ("nvmath", lambda t, fp64: on_gpu(t) and solvers.nvmath_eigen() is not None),
)
PATHS: dict[str, tuple[tuple[str, Callable[[torch.Tensor, bool], bool]], ...]] = {
    "segment_gram": (
        ("cpp", lambda t, fp64: fp64 and extension.BUILT and t.device.type == "cpu"),
        ("torch", _always),
        ("triton", lambda t, fp64: _triton_here(t)),
    ),
    "product_gram": (
        ("cpp", lambda t, fp64: fp64 and extension.BUILT and t.device.type == "cpu"),
        ("torch", _always),
    ),
    "segment_tdot": (
        ("torch", _always),
        ("triton", lambda t, fp64: _triton_here(t) and not fp64),
    ),
    "core": _EIGEN_PATHS,
    "gram": _EIGEN_PATHS,
}


# Paths left out of measurement above a size (they can still be forced): CuPy's batched Jacobi does about
# 20x the FLOPs of a tridiagonalisation at n = 512, and its first run at n = 4096 alone could spend a
# lent GPU's minutes.
MEASURED_UP_TO = {"cupy": 1024}


def paths(stage: str, t: torch.Tensor, policy: Policy) -> list[str]:
    """The paths this stage has for t at the policy's precision, preferred first (PATHS)."""
    if policy.backend == "cpp" and not extension.BUILT and stage in ("core", "gram"):
        raise RuntimeError("gradspec._C is not built: reinstall gradspec (pip install -e .)")
    fp64 = policy.precision == "fp64"
    return [name for name, exists in PATHS[stage] if exists(t, fp64)]


def _key(stage: str, policy: Policy, shape: tuple) -> tuple:
    return (stage, policy.precision, *shape)


def chosen_path(stage: str, t: torch.Tensor, policy: Policy, shape: tuple) -> str | None:
    """The path this stage will take for t: forced, the only one, the CPU's preference or the
    measured winner; None while it is still to be measured."""
    found = paths(stage, t, policy)
    name = policy.wanted(stage, found)
    if name is not None:
        return name
    if len(found) == 1 or not on_gpu(t):
        return found[0]
    return DISPATCH.choice(_key(stage, policy, shape))


def run(stage: str, t: torch.Tensor, policy: Policy, shape: tuple, calls: dict[str, Callable[[], T]]) -> T:
    """The chosen path's result; where the choice is open (on a GPU, not forced, several paths), through
    the measured dispatch, which measures the candidates first, and again after a failed one's
    RETRY_AFTER batches. The path taken is recorded in the policy (and so in the run's metadata)."""
    found = paths(stage, t, policy)
    name = policy.wanted(stage, found)
    if name is None and len(found) > 1 and on_gpu(t):
        key = _key(stage, policy, shape)
        n = t.shape[-1]  # the Grams' size, in the eigen stages (the only ones MEASURED_UP_TO names)
        candidates = {p: calls[p] for p in found if n <= MEASURED_UP_TO.get(p, n)}
        result = DISPATCH.run(key, candidates, _sync(t))
        name = DISPATCH.chosen.get(key, found[0])  # found[0] where it ran unmeasured
    else:
        name = name or found[0]
        result = calls[name]()
    policy.record(stage, name)
    return result
