"""Batched spectra of per-sample gradients from small symmetric Grams.

Each entry point has the C++ extension (gradspec._C: LAPACK via SciPy, threads over the
batch) and a torch fallback that gives the same numbers:

- ``segment_gram``: the per-sample Grams X X^T and D D^T (on CUDA: the Triton kernel or torch);
- ``gram_spectra``: from Grams of the materialised G (used when d_in or d_out is the smallest size);
- ``core_spectra``: from B = X X^T and A = D D^T, T x T (used when the token count is smallest).

On CUDA under backend "auto", each of them runs the path measured fastest for its size
(``DISPATCH``): for the eigen stages, the extension on the host's cores (fed by a copy), torch
on the GPU (cuSOLVER's batched eigensolver at every size since torch 2.12, pytorch#175403;
before that a loop over the matrices for n > 32) or, when CuPy is installed, cuSOLVER's batched
Jacobi through CuPy; for the Grams, the Triton kernel or torch. "cpp" and "torch" force a path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from . import kernels
from .dispatch import Fastest, size_bucket
from .metrics import metrics_from_singular_values, singular_values_from_gram_eigenvalues

log = logging.getLogger("gradspec")


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
        from . import _C
    except ImportError:
        return None
    _C.bind_lapack(**lapack_addresses())
    return _C


_C = _load_extension()
HAS_EXTENSION = _C is not None
# The extension parallelises over the batch; BLAS threads inside each task would oversubscribe
# the cores (measured 4x slower on 2 cores), so SciPy's BLAS runs single-threaded during a call
# (the extension does the same for MKL on its own threads).
_BLAS = ThreadpoolController() if HAS_EXTENSION else None


# On CUDA, the fastest path per (stage, size bucket), measured on the first batch that needs it.
DISPATCH = Fastest()


def default_threads() -> int:
    return int(os.environ.get("GRADSPEC_THREADS", 0)) or torch.get_num_threads()


def _use_extension(backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "cpp":
        if not HAS_EXTENSION:
            raise RuntimeError("gradspec._C is not built: reinstall gradspec (pip install -e .)")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'cpp' or 'torch', got {backend!r}")
    return HAS_EXTENSION


def segment_gram(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sample Gram Y_i Y_i^T over valid tokens (N, T, T), and <Gram_i, other_i> when other is given.

    CUDA: the Triton kernel (fp32 accumulation) or torch's fp64 path, whichever is measured
    faster for the shape ("torch" forces the latter). CPU: the extension's dsyrk in fp64 (half
    a GEMM's work, none on padding), else the fp64 torch reference.
    """
    if _on_gpu(Y):
        run_torch = partial(kernels.segment_gram_torch, Y, lengths, other)
        if backend == "torch":
            return run_torch()
        triton_path = partial(kernels.segment_gram_triton, Y, lengths, other)
        return _kernel_or_torch("segment_gram", Y, (Y.shape[2], other is not None), triton_path, run_torch)
    if not _use_extension(backend):
        return kernels.segment_gram_torch(Y, lengths, other)
    Y = Y.detach() if Y.dtype in (torch.float32, torch.float64) else Y.detach().float()
    with _BLAS.limit(limits=1, user_api="blas"):
        gram = torch.from_numpy(_C.segment_gram(Y.numpy(), lengths.to(torch.int64).numpy(), default_threads()))
    return gram, None if other is None else (gram * other.to(gram)).sum((1, 2))


def segment_tdot(A: torch.Tensor, B: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sample A_i^T B_i over valid tokens, (N, p, q): on CUDA the Triton kernel or torch's
    fp64 path, whichever is measured faster for the shape; elsewhere torch."""
    run_torch = partial(kernels.segment_tdot_torch, A, B, lengths)
    if not _on_gpu(A):
        return run_torch()
    triton_path = partial(kernels.segment_tdot_triton, A, B, lengths)
    return _kernel_or_torch("segment_tdot", A, (A.shape[2], B.shape[2]), triton_path, run_torch)


def _kernel_or_torch(stage: str, t: torch.Tensor, shape: tuple, run_triton: Callable, run_torch: Callable):
    """A Triton kernel or its torch equivalent, whichever is measured faster for this token count
    (bucketed) and shape; torch where Triton is not installed."""
    if kernels.triton is None:
        return run_torch()
    key = (stage, size_bucket(t.shape[1]), *shape)
    return DISPATCH.run(key, {"triton": run_triton, "torch": run_torch}, _sync(t))


def eigen_path(grams: torch.Tensor, backend: str, stage: str) -> str | None:
    """Where this eigen stage will run: "cpp" (the extension, on the host), "torch" or "cupy" (on
    the Grams' device), or None while it is still to be measured. The engine copies the Grams of
    "cpp" stages off the GPU early, on its own thread; the others stay where they are."""
    paths = _eigen_paths(grams, backend)
    return paths[0] if len(paths) == 1 else DISPATCH.choice(_eigen_key(stage, grams))


def _eigen_paths(grams: torch.Tensor, backend: str) -> list[str]:
    if backend == "torch":
        return ["torch"]
    if backend == "cpp" or not _on_gpu(grams):
        return ["cpp"] if _use_extension(backend) else ["torch"]
    return ["torch"] + ["cupy"] * (_cupy_eigen() is not None) + ["cpp"] * HAS_EXTENSION


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether paths are measured against each other for t: on a GPU. On the CPU the extension
    wins at every size (benchmarks/bench_eigen.py), and a fixed path keeps reruns bit-identical."""
    return t.is_cuda


def _sync(t: torch.Tensor) -> Callable[[], None]:
    return partial(torch.cuda.synchronize, t.device) if t.is_cuda else (lambda: None)


def _eigen_key(stage: str, grams: torch.Tensor) -> tuple:
    return (stage, size_bucket(grams.shape[-1]))


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


def _eigen_stage(stage: str, grams: torch.Tensor, backend: str, run_cpp: Callable, run_device: Callable):
    """run_cpp() on the host, or run_device(eigensolver) where the Grams are: the one path there
    is, or the fastest, measured on first use per size. Out of GPU memory (the next batch's
    forward shares it), a measured stage falls back to the host for this call."""
    calls = {"cpp": run_cpp, "torch": partial(run_device, TORCH_EIGEN), "cupy": lambda: run_device(_cupy_eigen())}
    paths = _eigen_paths(grams, backend)
    if len(paths) == 1:
        return calls[paths[0]]()
    try:
        return DISPATCH.run(_eigen_key(stage, grams), {p: calls[p] for p in paths}, _sync(grams))
    except torch.OutOfMemoryError:
        if "cpp" not in paths:
            raise
        log.warning("out of GPU memory in the %s eigen stage (n = %d); solved on the host", stage, grams.shape[-1])
        torch.cuda.empty_cache()
        return run_cpp()


def gram_spectra(grams: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(N, n, n) Grams of G -> singular values of G (N, n) descending, metrics (N, n_metrics), on the CPU."""
    return _eigen_stage("gram", grams, backend, partial(_gram_cpp, grams), partial(_gram_device, grams))


def _gram_cpp(grams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with _BLAS.limit(limits=1, user_api="blas"):
        sigma, metrics = _C.gram_spectra(_as_numpy(grams), default_threads())
    return torch.from_numpy(sigma), torch.from_numpy(metrics)


def _gram_device(grams: torch.Tensor, eigen: Eigensolver) -> tuple[torch.Tensor, torch.Tensor]:
    sigma = singular_values_from_gram_eigenvalues(eigen.eigvalsh(grams.double()))
    return sigma.cpu(), metrics_from_singular_values(sigma).cpu()


def core_spectra(
    B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """B = X X^T (N, T, T) and A_j = D_j D_j^T (N, M, T, T) -> sigma (N, M, T), metrics (N, M, n_metrics), on the CPU.

    For any F with B = F F^T, the singular values of D_j^T X are the square roots of the
    eigenvalues of F^T A_j F. The extension takes F from a pivoted Cholesky; the torch path
    from B's eigendecomposition, F = U L^(1/2), dropping directions below n * eps * max(L).
    ``lengths`` (N,) are the tokens per sample: beyond them B and A are zero padding, which
    the extension skips (the torch path computes through it: same result, more work).
    """
    if lengths is None:
        lengths = torch.full((B.shape[0],), B.shape[-1], dtype=torch.int64)
    return _eigen_stage("core", B, backend, partial(_core_cpp, B, A, lengths), partial(_core_device, B, A, lengths))


def _core_cpp(B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with _BLAS.limit(limits=1, user_api="blas"):
        sigma, metrics = _C.core_spectra(
            _as_numpy(B), _as_numpy(A), lengths.cpu().to(torch.int64).numpy(), default_threads()
        )
    return torch.from_numpy(sigma), torch.from_numpy(metrics)


def _core_device(
    B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, eigen: Eigensolver
) -> tuple[torch.Tensor, torch.Tensor]:
    B, A = B.double(), A.double()
    lam, U = eigen.eigh(B)
    cutoff = lengths.to(B.device)[:, None] * torch.finfo(torch.float64).eps * lam.amax(-1, keepdim=True).clamp_min(0)
    F = U * torch.where(lam > cutoff, lam, 0.0).sqrt().unsqueeze(-2)
    core = F.unsqueeze(1).transpose(-1, -2) @ A @ F.unsqueeze(1)
    sigma = singular_values_from_gram_eigenvalues(eigen.eigvalsh(core))
    return sigma.cpu(), metrics_from_singular_values(sigma).cpu()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).contiguous().numpy()
