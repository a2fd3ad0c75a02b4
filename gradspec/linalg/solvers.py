"""Batched symmetric eigensolvers that work where their input lies: torch's (LAPACK on the host,
cuSOLVER on a GPU), CuPy's (cuSOLVER's syevjBatched at every size), when CuPy is installed, and
cuSOLVER's XsyevBatched at every size (values only) through nvmath-python, when it is installed and
its cuSOLVER has it (CUDA 12.6 update 2 or later)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cache
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger("gradspec")


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
        import cupyx
    except ImportError:
        return None
    return eigensolver_via(cupy, cupyx.errstate)


def eigensolver_via(cupy, errstate: Callable[..., AbstractContextManager]) -> Eigensolver:
    """An Eigensolver on torch's CUDA tensors through CuPy: zero-copy by DLPack, on torch's stream.
    Under errstate(linalg="raise") (cupyx.errstate): by default CuPy ignores the solver's status, so
    a matrix that did not converge would come back as garbage; this way it raises LinAlgError, which
    the eigen stage retries on the host (one wait for the device per call, as on the nvmath path)."""

    @contextmanager
    def as_cupy(a: torch.Tensor) -> Iterator:
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(a.device).cuda_stream)
        with cupy.cuda.Device(a.device.index), stream, errstate(linalg="raise"):
            yield cupy.from_dlpack(a.reshape(-1, *a.shape[-2:]).contiguous())

    def eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with as_cupy(a) as x:
            w, v = cupy.linalg.eigh(x)
            return torch.from_dlpack(w).view(a.shape[:-1]), torch.from_dlpack(v).view(a.shape)

    def eigvalsh(a: torch.Tensor) -> torch.Tensor:
        with as_cupy(a) as x:
            return torch.from_dlpack(cupy.linalg.eigvalsh(x)).view(a.shape[:-1])

    return Eigensolver(eigh, eigvalsh)


class SyevConstants(NamedTuple):
    """The enum values cusolverDnXsyevBatched takes (nvmath-python exposes them as
    nvmath.bindings.cusolver.EigMode, nvmath.bindings.cublas.FillMode and nvmath.CudaDataType)."""

    novector: int  # cusolverEigMode_t CUSOLVER_EIG_MODE_NOVECTOR: eigenvalues only
    upper: int  # cublasFillMode_t CUBLAS_FILL_MODE_UPPER
    r32f: int  # cudaDataType_t CUDA_R_32F
    r64f: int  # cudaDataType_t CUDA_R_64F


CUSOLVER_CONSTANTS = SyevConstants(novector=0, upper=1, r32f=0, r64f=1)  # as cusolver_common.h and
# library_types.h define them; nvmath_eigen() takes nvmath's own enums


def _torch_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# One XsyevBatched call's limits: cuSOLVER needs n * lda * batch below 2**31, and large batches have been
# reported to fail with INVALID_VALUE; a longer batch is solved in chunks within both.
MAX_SYEV_ELEMENTS = 2**31 - 1
MAX_SYEV_BATCH = 16_384


def syev_batched_via(
    binding, constants: SyevConstants = CUSOLVER_CONSTANTS, *,
    stream_of: Callable[[torch.device], int] = _torch_stream,
    device_guard: Callable[[torch.device], AbstractContextManager] = torch.cuda.device,
    max_elements: int = MAX_SYEV_ELEMENTS, max_batch: int = MAX_SYEV_BATCH,
) -> Eigensolver:
    """An Eigensolver on torch's CUDA tensors through cuSOLVER's cusolverDnXsyevBatched (batched
    tridiagonalisation, at every n since the cuSOLVER of CUDA 12.6 update 2; torch before 2.12 takes
    it for n <= 32 only and loops syevd above: pytorch#175585), `binding` a module with nvmath.bindings.cusolverDn's
    create, create_params, set_stream, xsyev_batched_buffer_size and xsyev_batched.

    Values only (jobz NOVECTOR); `eigh` is torch.linalg.eigh. Each call solves a packed copy of the
    input in its dtype (fp32 or fp64; any other is solved in fp64), which the solver overwrites: the
    caller's tensor is left as it was. The copy is row-major, cuSOLVER column-major: each matrix is
    read as its transpose, so lda = n and FILL_MODE_UPPER reads the triangle torch.linalg.eigvalsh
    reads (UPLO="L"). The work runs on torch's current stream of the input's device, with that
    device current (`stream_of`, `device_guard`: injectable, for tests on the host), its device
    workspace from torch's caching allocator on that stream; one handle and params object per
    device, made on first use and kept. A batch past one call's limits (max_elements, max_batch) is
    solved in chunks. `info` is read back once per call, after the solves: the call's only wait for
    the device (its host workspaces are kept alive until then); a matrix that did not converge
    raises torch.linalg.LinAlgError naming its batch index. No autograd."""
    handles: dict[int | None, tuple[int, int]] = {}  # device index -> (handle, params)
    lock = threading.Lock()  # one handle per device, its stream set per call: calls one at a time

    def handle_of(device: torch.device) -> tuple[int, int]:
        if device.index not in handles:
            handles[device.index] = binding.create(), binding.create_params()
        return handles[device.index]

    def eigvalsh(a: torch.Tensor) -> torch.Tensor:
        n, batch = a.shape[-1], a.shape[:-2]
        dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float64
        count = math.prod(batch)
        if count == 0 or n == 0:
            return a.new_empty((*batch, n), dtype=dtype)
        kind = constants.r64f if dtype == torch.float64 else constants.r32f
        chunk = max(1, min(max_batch, max_elements // (n * n)))
        hosts = []  # each solve's host workspace, held until the device is done with it
        with device_guard(a.device), lock:
            work = torch.empty((count, n, n), dtype=dtype, device=a.device)
            work.copy_(a.reshape(count, n, n))
            w = torch.empty((count, n), dtype=dtype, device=a.device)
            info = torch.zeros(count, dtype=torch.int32, device=a.device)
            handle, params = handle_of(a.device)
            binding.set_stream(handle, stream_of(a.device))
            for start in range(0, count, chunk):
                size = min(chunk, count - start)
                problem = (handle, params, constants.novector, constants.upper, n, kind, work[start].data_ptr(), n,
                           kind, w[start].data_ptr(), kind)
                device_bytes, host_bytes = binding.xsyev_batched_buffer_size(*problem, size)
                on_device = torch.empty(device_bytes, dtype=torch.uint8, device=a.device)
                hosts.append(torch.empty(host_bytes, dtype=torch.uint8))
                binding.xsyev_batched(*problem, on_device.data_ptr(), device_bytes, hosts[-1].data_ptr(), host_bytes,
                                      info[start].data_ptr(), size)
        _raise_on_failure(info.cpu(), batch)  # the one wait for the device; the host workspaces are held until then
        return w.view(*batch, n)

    return Eigensolver(torch.linalg.eigh, eigvalsh)


def _raise_on_failure(info: torch.Tensor, batch: torch.Size) -> None:
    """XsyevBatched's info per matrix: 0 solved, i > 0 did not converge, -i its i-th parameter was wrong."""
    failed = torch.nonzero(info).flatten()
    if not len(failed):
        return
    first = int(failed[0])
    code = int(info[first])
    if code < 0:
        raise ValueError(f"cusolverDnXsyevBatched: parameter {-code} is wrong (info = {code})")
    where = tuple(int(i) for i in np.unravel_index(first, tuple(batch))) if len(batch) > 1 else first
    raise torch.linalg.LinAlgError(
        f"cusolverDnXsyevBatched did not converge on matrix {where} of the batch {tuple(batch)} (info = {code}); "
        f"{len(failed)} of {len(info)} failed")


class _Nvmath(NamedTuple):
    solver: Eigensolver | None
    reason: str  # why solver is None ("" where it is not)
    broken: bool  # present but failing its small solve (not merely absent: no package, GPU or XsyevBatched)


@cache
def _nvmath() -> _Nvmath:
    try:
        import nvmath
        from nvmath.bindings import cublas, cusolver, cusolverDn
    except ImportError:
        return _Nvmath(None, "nvmath-python is not installed", False)
    if not torch.cuda.is_available():
        return _Nvmath(None, "no CUDA device", False)
    if not hasattr(cusolverDn, "xsyev_batched"):
        return _Nvmath(None, "this nvmath-python has no cusolverDn.xsyev_batched", False)
    try:
        constants = SyevConstants(int(cusolver.EigMode.NOVECTOR), int(cublas.FillMode.UPPER),
                                  int(nvmath.CudaDataType.CUDA_R_32F), int(nvmath.CudaDataType.CUDA_R_64F))
        solver = syev_batched_via(cusolverDn, constants)
        probe = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64, device="cuda").expand(3, 2, 2)
        got = solver.eigvalsh(probe).cpu()
    except Exception as error:  # noqa: BLE001 - told apart by _failed_probe: absent, or a binding that fails
        return _failed_probe(error)
    if not torch.allclose(got, torch.tensor([1.0, 3.0], dtype=torch.float64).expand(3, 2)):
        return _broken_nvmath(f"cusolverDnXsyevBatched gave {got.tolist()} for eigenvalues [1, 3]")
    return _Nvmath(solver, "", False)


def _failed_probe(error: Exception) -> _Nvmath:
    """The small solve raised: a cuSOLVER without the symbol (nvmath's FunctionNotFoundError) is absent;
    anything else (a wrong argument, a status other than success) is a broken binding."""
    if type(error).__name__ == "FunctionNotFoundError":
        return _Nvmath(None, "cusolverDnXsyevBatched is not in this cuSOLVER: it needs CUDA 12.6 update 2 or later",
                       False)
    return _broken_nvmath(f"cusolverDnXsyevBatched failed ({type(error).__name__}: {str(error)[:200]})")


def _broken_nvmath(reason: str) -> _Nvmath:
    log.warning("%s: the nvmath eigen path is left out", reason)
    return _Nvmath(None, reason, True)


@cache
def nvmath_eigen() -> Eigensolver | None:
    """cuSOLVER's XsyevBatched through nvmath-python (syev_batched_via), or None where nvmath-python is
    not installed, there is no CUDA device, or its cuSOLVER lacks XsyevBatched or fails a small solve
    (nvmath_unavailable() says which)."""
    return _nvmath().solver


def nvmath_unavailable() -> str:
    """Why nvmath_eigen() is None ("" where it is not)."""
    return _nvmath().reason


def nvmath_broken() -> bool:
    """Whether nvmath_eigen() is None because the binding failed its small solve, not for want of
    nvmath-python, a GPU or XsyevBatched: a defect to report, not an optional path left out."""
    return _nvmath().broken
