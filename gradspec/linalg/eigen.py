"""Batched spectra of per-sample gradients from small symmetric Grams.

Four stages (gradspec.linalg.policy.STAGES), each with paths that give the same numbers at one precision:

- ``segment_gram``: per-sample Grams X X^T and D D^T: the C++ extension's dsyrk (host, fp64),
  torch (at the policy's precision) or the Triton kernel (fp32 accumulation: fp32 policy only);
- ``segment_tdot``: the low-rank sketch's per-sample A^T B: torch, or the Triton kernel (fp32 only);
- ``gram_spectra``: spectra from Grams of the materialised G (d_in or d_out the smallest size);
- ``core_spectra``: spectra from B = X X^T and A = D D^T, T x T (the token count the smallest).
  The eigen stages solve in fp64 with the extension on the host (LAPACK, threads over the
  batch), torch on the Grams' device (cuSOLVER's batched eigensolver since torch 2.12) or CuPy.

Which path runs is the policy's (gradspec.linalg.policy): forced, else measured on a GPU, else the first
of a fixed preference, so CPU reruns are bit-identical. An eigen stage that fails (out of
memory, a solver that does not converge) is solved again on the host; the caller isolates
what still fails.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from gradspec import kernels
from gradspec.linalg.blas_threads import OneBlasThread
from gradspec.linalg.dispatch import MeasuredDispatch, size_bucket
from gradspec.linalg.metrics import (
    EPS64,
    eigenvalue_cutoff,
    metrics_from_singular_values,
    singular_values_from_gram_eigenvalues,
)
from gradspec.linalg.policy import Policy

log = logging.getLogger("gradspec")
T = TypeVar("T")


def _capsule_address(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(capsule, name(capsule))


def lapack_addresses(prefer_mkl: bool = True) -> dict[str, int]:
    """SciPy's BLAS/LAPACK, with dsyevd and dgemm from the MKL inside torch's CPU build where
    it exports them: MKL's small-matrix eigensolver is about 2x faster than OpenBLAS's."""
    from scipy.linalg import cython_blas, cython_lapack

    lapack, blas = cython_lapack.__pyx_capi__, cython_blas.__pyx_capi__
    found = {name: _capsule_address(caps[name]) for caps, name in
             ((lapack, "dsyevd"), (lapack, "dpstrf"), (blas, "dgemm"), (blas, "dsyrk"))}
    if not prefer_mkl:
        return found
    try:
        torch_lib = Path(torch.__file__).parent / "lib"
        mkl = ctypes.CDLL(str(torch_lib / "libtorch_cpu.so"))
        omp = ctypes.CDLL(str(torch_lib / "libgomp.so.1"))
        mkl_found = {
            "dsyevd": ctypes.cast(mkl.dsyevd_, ctypes.c_void_p).value,
            "dgemm": ctypes.cast(mkl.dgemm_, ctypes.c_void_p).value,
            "omp_set_num_threads": ctypes.cast(omp.omp_set_num_threads, ctypes.c_void_p).value,
        }
    except (OSError, AttributeError):
        return found
    return {**found, **mkl_found}


def _load_extension():
    """The C++ extension with BLAS/LAPACK bound, or None when it is not built."""
    try:
        from gradspec import _C
    except ImportError:
        return None
    _C.bind_lapack(**lapack_addresses())
    return _C


_C = _load_extension()
HAS_EXTENSION = _C is not None
# SciPy's BLAS at one thread while the extension runs (see gradspec.linalg.blas_threads).
ONE_BLAS_THREAD = OneBlasThread(ThreadpoolController() if HAS_EXTENSION else None)


# On a GPU, the fastest path per (stage, precision, size bucket), measured on the first batch that needs it.
DISPATCH = MeasuredDispatch()
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def default_threads() -> int:
    return int(os.environ.get("GRADSPEC_THREADS", 0)) or torch.get_num_threads()


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether paths are measured against each other for t: on a GPU. On the CPU the extension
    wins at every size (benchmarks/bench_eigen.py), and a fixed path keeps reruns bit-identical."""
    return t.is_cuda


def _sync(t: torch.Tensor) -> Callable[[], None]:
    return partial(torch.cuda.synchronize, t.device) if t.is_cuda else (lambda: None)


def paths(stage: str, t: torch.Tensor, policy: Policy) -> list[str]:
    """The paths this stage has for t at the policy's precision, preferred first."""
    fp64 = policy.precision == "fp64"
    triton_here = kernels.triton is not None and not fp64 and (t.is_cuda or TRITON_INTERPRETED)
    if stage == "segment_gram":
        found = ["cpp"] * (fp64 and HAS_EXTENSION and not t.is_cuda) + ["torch"] + ["triton"] * triton_here
    elif stage == "segment_tdot":
        found = ["torch"] + ["triton"] * triton_here
    else:
        found = ["cpp"] * HAS_EXTENSION + ["torch"] + ["cupy"] * (_on_gpu(t) and _cupy_eigen() is not None)
    if policy.backend == "cpp" and not HAS_EXTENSION and stage in ("core", "gram"):
        raise RuntimeError("gradspec._C is not built: reinstall gradspec (pip install -e .)")
    return found


def _key(stage: str, t: torch.Tensor, policy: Policy, shape: tuple) -> tuple:
    return (stage, policy.precision, *shape)


def chosen_path(stage: str, t: torch.Tensor, policy: Policy, shape: tuple) -> str | None:
    """The path this stage will take for t: forced, the only one, the CPU's preference or the
    measured winner; None while it is still to be measured."""
    found = paths(stage, t, policy)
    name = policy.wanted(stage, found)
    if name is not None:
        return name
    if len(found) == 1 or not _on_gpu(t):
        return found[0]
    return DISPATCH.choice(_key(stage, t, policy, shape))


def _run(stage: str, t: torch.Tensor, policy: Policy, shape: tuple, calls: dict[str, Callable[[], T]]) -> T:
    """The chosen path's result, measuring the candidates first where the choice is open."""
    name = chosen_path(stage, t, policy, shape)
    if name is None:
        key = _key(stage, t, policy, shape)
        result = DISPATCH.run(key, {p: calls[p] for p in paths(stage, t, policy)}, _sync(t))
        name = DISPATCH.choice(key)
    else:
        result = calls[name]()
    policy.record(stage, name)
    return result


def segment_gram(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None, policy: Policy | str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sample Gram Y_i Y_i^T over valid tokens (N, T, T) in the policy's precision, and
    <Gram_i, other_i> when other is given. lengths lie on Y's device (the host copy for the
    extension is then free, or the caller's own once per batch)."""
    policy = Policy.of(policy)
    dtype = policy.dtype
    calls = {
        "cpp": partial(_segment_gram_cpp, Y, lengths, other),
        "torch": partial(kernels.segment_gram_torch, Y, lengths, other, dtype),
        "triton": partial(kernels.segment_gram_triton, Y, lengths, other),
    }
    return _run("segment_gram", Y, policy, (size_bucket(Y.shape[1]), Y.shape[2], other is not None), calls)


def _segment_gram_cpp(Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None):
    Y = Y.detach() if Y.dtype in (torch.float32, torch.float64) else Y.detach().float()
    with ONE_BLAS_THREAD():
        gram = torch.from_numpy(_C.segment_gram(Y.numpy(), lengths.cpu().to(torch.int64).numpy(), default_threads()))
    return gram, None if other is None else (gram * other.to(gram)).sum((1, 2))


def segment_tdot(
    A: torch.Tensor, B: torch.Tensor, lengths: torch.Tensor, policy: Policy | str = "auto"
) -> torch.Tensor:
    """Per-sample A_i^T B_i over valid tokens, (N, p, q), in the policy's precision."""
    policy = Policy.of(policy)
    calls = {
        "torch": partial(kernels.segment_tdot_torch, A, B, lengths, policy.dtype),
        "triton": partial(kernels.segment_tdot_triton, A, B, lengths),
    }
    return _run("segment_tdot", A, policy, (size_bucket(A.shape[1]), A.shape[2], B.shape[2]), calls)


def eigen_path(grams: torch.Tensor, policy: Policy | str, stage: str) -> str | None:
    """Where this eigen stage will run: "cpp" (the extension, on the host), "torch" or "cupy" (on
    the Grams' device), or None while it is still to be measured. The engine copies the Grams of
    "cpp" stages off the GPU early, on its own thread; the others stay where they are."""
    return chosen_path(stage, grams, Policy.of(policy), (size_bucket(grams.shape[-1]),))


class Eigensolver(NamedTuple):
    """A batched symmetric eigensolver that works where its input lies (eigenvalues in any order)."""

    eigh: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    eigvalsh: Callable[[torch.Tensor], torch.Tensor]


TORCH_EIGEN = Eigensolver(torch.linalg.eigh, torch.linalg.eigvalsh)


@cache
def _cupy_eigen() -> Eigensolver | None:
    """CuPy's batched eigensolver (cuSOLVER's syevjBatched at every size), when CuPy is installed."""
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


def eigen_faults() -> tuple[type[BaseException], ...]:
    """What an eigen path raises when it fails on its input or its device, not on a bug: out of
    (GPU) memory, a solver that does not converge (LAPACK info > 0, torch's or NumPy's LinAlgError)."""
    faults: list[type[BaseException]] = [torch.OutOfMemoryError, torch.linalg.LinAlgError, np.linalg.LinAlgError]
    if HAS_EXTENSION:
        faults.append(_C.LapackError)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        faults.append(cupy.cuda.memory.OutOfMemoryError)
    return tuple(faults)


def _eigen_stage(stage: str, tensors: tuple, policy: Policy, on_host: Callable, on_device: Callable):
    """on_host(*tensors) through the extension, or on_device(eigensolver, *tensors) where they lie:
    the policy's path. A path that fails (eigen_faults) is retried on the host, by the extension
    and then by torch; what fails there too is raised, for the caller to isolate."""
    calls = {"cpp": partial(on_host, *tensors), "torch": partial(on_device, TORCH_EIGEN, *tensors),
             "cupy": lambda: on_device(_cupy_eigen(), *tensors)}
    try:
        return _run(stage, tensors[0], policy, (size_bucket(tensors[0].shape[-1]),), calls)
    except eigen_faults() as error:
        failure = error
    if tensors[0].is_cuda:
        torch.cuda.empty_cache()
    host = tuple(t.cpu() for t in tensors)
    retries = {"cpp": partial(on_host, *host)} if HAS_EXTENSION else {}
    retries["torch"] = partial(on_device, TORCH_EIGEN, *host)
    for name, retry in retries.items():
        try:
            result = retry()
        except eigen_faults() as error:
            failure = error
            continue
        log.warning("%s eigen stage (%d matrices, n = %d) failed (%s: %s); solved on the host by %s", stage,
                    tensors[0].shape[0], tensors[0].shape[-1], type(failure).__name__, failure, name)
        policy.record(stage, name)
        return result
    raise failure


def gram_spectra(
    grams: torch.Tensor, policy: Policy | str = "auto", terms: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, n, n) Grams of G -> singular values of G (N, n) descending, metrics (N, n_metrics), on the CPU.
    Eigenvalues below max(n, terms) * eps * max are the Grams' rounding (eps: the policy's
    precision; terms: the length of the sums that formed G and its Grams)."""
    policy = Policy.of(policy)
    return _eigen_stage("gram", (grams,), policy, partial(_gram_cpp, eps=policy.eps, terms=terms),
                        partial(_gram_device, eps=policy.eps, terms=terms))


def _gram_cpp(grams: torch.Tensor, eps: float, terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    with ONE_BLAS_THREAD():
        sigma, metrics = _C.gram_spectra(_as_numpy(grams), default_threads(), eps, terms)
    return torch.from_numpy(sigma), torch.from_numpy(metrics)


def _gram_device(
    eigen: Eigensolver, grams: torch.Tensor, eps: float = EPS64, terms: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    sigma = singular_values_from_gram_eigenvalues(eigen.eigvalsh(grams.double()), eps, terms)
    return sigma.cpu(), metrics_from_singular_values(sigma).cpu()


def core_spectra(
    B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor | None = None, policy: Policy | str = "auto",
    terms: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B = X X^T (N, T, T) and A_j = D_j D_j^T (N, M, T, T) -> sigma (N, M, T), metrics (N, M, n_metrics), on the CPU.

    For any F with B = F F^T, the singular values of D_j^T X are the square roots of the
    eigenvalues of F^T A_j F. The extension takes F from a pivoted Cholesky; the device paths
    from B's eigendecomposition, F = U L^(1/2); both drop directions below max(n, terms) * eps
    * max (eps: the policy's precision; terms: the feature sizes the Grams summed over).
    ``lengths`` (N,) are the tokens per sample: beyond them B and
    A are zero padding, which the extension skips (the device paths compute through it).
    """
    policy = Policy.of(policy)
    if lengths is None:
        lengths = torch.full((B.shape[0],), B.shape[-1], dtype=torch.int64)
    return _eigen_stage("core", (B, A, lengths), policy, partial(_core_cpp, eps=policy.eps, terms=terms),
                        partial(_core_device, eps=policy.eps, terms=terms))


def _core_cpp(
    B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, eps: float, terms: int
) -> tuple[torch.Tensor, torch.Tensor]:
    with ONE_BLAS_THREAD():
        sigma, metrics = _C.core_spectra(
            _as_numpy(B), _as_numpy(A), lengths.cpu().to(torch.int64).numpy(), default_threads(), eps, terms
        )
    return torch.from_numpy(sigma), torch.from_numpy(metrics)


def _core_device(
    eigen: Eigensolver, B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, eps: float = EPS64, terms: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    B, A = B.double(), A.double()
    lam, U = eigen.eigh(B)
    keep = lam > eigenvalue_cutoff(lam, lengths.to(B.device)[:, None], eps, terms)
    F = U * torch.where(keep, lam, 0.0).sqrt().unsqueeze(-2)
    core = F.unsqueeze(1).transpose(-1, -2) @ A @ F.unsqueeze(1)
    sigma = singular_values_from_gram_eigenvalues(eigen.eigvalsh(core), eps, terms)
    return sigma.cpu(), metrics_from_singular_values(sigma).cpu()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).contiguous().numpy()
