"""Batched symmetric eigensolvers that work where their input lies: torch's (LAPACK on the host,
cuSOLVER on a GPU) and CuPy's (cuSOLVER's syevjBatched at every size), when CuPy is installed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import NamedTuple

import torch


class Eigensolver(NamedTuple):
    """A batched symmetric eigensolver that works where its input lies (eigenvalues in any order)."""

    eigh: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    eigvalsh: Callable[[torch.Tensor], torch.Tensor]


TORCH_EIGEN = Eigensolver(torch.linalg.eigh, torch.linalg.eigvalsh)


@cache
def cupy_eigen() -> Eigensolver | None:
    """CuPy's batched eigensolver, or None when CuPy is not installed."""
    try:
        import cupy
    except ImportError:
        return None
    return eigensolver_via(cupy)


def eigensolver_via(cupy) -> Eigensolver:
    """An Eigensolver on torch's CUDA tensors through CuPy: zero-copy by DLPack, on torch's stream."""

    @contextmanager
    def as_cupy(a: torch.Tensor) -> Iterator:
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(a.device).cuda_stream)
        with cupy.cuda.Device(a.device.index), stream:
            yield cupy.from_dlpack(a.reshape(-1, *a.shape[-2:]).contiguous())

    def eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with as_cupy(a) as x:
            w, v = cupy.linalg.eigh(x)
            return torch.from_dlpack(w).view(a.shape[:-1]), torch.from_dlpack(v).view(a.shape)

    def eigvalsh(a: torch.Tensor) -> torch.Tensor:
        with as_cupy(a) as x:
            return torch.from_dlpack(cupy.linalg.eigvalsh(x)).view(a.shape[:-1])

    return Eigensolver(eigh, eigvalsh)
