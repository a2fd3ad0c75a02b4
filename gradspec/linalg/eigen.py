"""Spectra of per-sample gradients from their small symmetric Grams, solved in fp64.

``gram_spectra``: from Grams of the materialised G (d_in or d_out the smallest size);
``core_spectra``: from B = X X^T and A = D D^T, T x T (the token count the smallest).
Each runs on the extension on the host (LAPACK, threads over the batch), or torch, CuPy or
cuSOLVER's XsyevBatched through nvmath-python where the Grams lie (gradspec.linalg.stages picks).
A path that fails (out of memory, a solver that does not converge) is solved again on the host; the
caller isolates what still fails.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from gradspec.linalg import extension, solvers, stages
from gradspec.linalg.dispatch import size_bucket
from gradspec.linalg.host_copies import to_device
from gradspec.linalg.metrics import (
    EPS64,
    eigenvalue_cutoff,
    metrics_from_singular_values,
    metrics_of_groups,
    singular_values_from_gram_eigenvalues,
)
from gradspec.linalg.policy import Policy
from gradspec.linalg.solvers import Eigensolver

log = logging.getLogger("gradspec")


def eigen_path(grams: torch.Tensor, policy: Policy | str, stage: str) -> str | None:
    """Where this eigen stage will run: "cpp" (the extension, on the host), "torch", "cupy" or
    "nvmath" (on the Grams' device), or None while it is still to be measured. The engine copies
    the Grams of "cpp" stages off the GPU early, on its own thread; the others stay where they are."""
    return stages.chosen_path(stage, grams, Policy.of(policy), (size_bucket(grams.shape[-1]),))


def eigen_faults() -> tuple[type[BaseException], ...]:
    """What an eigen path raises when it fails on its input or its device, not on a bug: out of
    (GPU) memory, a solver that does not converge (LAPACK info > 0, torch's or NumPy's LinAlgError)."""
    faults: list[type[BaseException]] = [torch.OutOfMemoryError, torch.linalg.LinAlgError, np.linalg.LinAlgError]
    if extension.BUILT:
        faults.append(extension.C.LapackError)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        faults.append(cupy.cuda.memory.OutOfMemoryError)
    cusolver = sys.modules.get("nvmath.bindings.cusolver")  # a cuSOLVER status other than success
    if cusolver is not None:
        faults.append(cusolver.cuSOLVERError)
    return tuple(faults)


def _eigen_stage(stage: str, tensors: tuple, policy: Policy, on_host: Callable, on_device: Callable):
    """on_host(*tensors) through the extension, or on_device(eigensolver, *tensors) where they lie:
    the policy's path. A path that fails (eigen_faults) is retried on the host, by the extension
    and then by torch; what fails there too is raised, for the caller to isolate."""
    calls = {"cpp": partial(on_host, *tensors), "torch": partial(on_device, solvers.TORCH_EIGEN, *tensors),
             "cupy": lambda: on_device(solvers.cupy_eigen(), *tensors),
             "nvmath": lambda: on_device(solvers.nvmath_eigen(), *tensors)}
    try:
        return stages.run(stage, tensors[0], policy, (size_bucket(tensors[0].shape[-1]),), calls)
    except eigen_faults() as error:
        failure = error
    if tensors[0].is_cuda:
        torch.cuda.empty_cache()
    host = tuple(t.cpu() for t in tensors)
    retries = {"cpp": partial(on_host, *host)} if extension.BUILT else {}
    retries["torch"] = partial(on_device, solvers.TORCH_EIGEN, *host)
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
    grams: torch.Tensor, policy: Policy | str = "auto", terms: int = 0, metrics: tuple[str, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, n, n) Grams of G -> singular values of G (N, n) descending, metrics (N, len(metrics)), on the CPU
    (metrics: registered names, default all). Eigenvalues below max(n, terms) * eps * max are the Grams'
    rounding (eps: the policy's precision; terms: the length of the sums that formed G and its Grams)."""
    policy = Policy.of(policy)
    sigma = _eigen_stage("gram", (grams,), policy, partial(_gram_cpp, eps=policy.eps, terms=terms),
                         partial(_gram_device, eps=policy.eps, terms=terms))
    return sigma, metrics_from_singular_values(sigma, metrics)


def host_gram_spectra(
    groups: list[tuple[torch.Tensor, int]], policy: Policy | str = "auto", metrics: tuple[str, ...] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """gram_spectra of several groups (grams (N, n, n), terms), solved by the extension in one job over
    every sample of every group (host_core_spectra's reason). (sigma, metrics) per group."""
    policy = Policy.of(policy)
    with extension.ONE_BLAS_THREAD():
        sigmas = extension.C.gram_spectra_groups([extension.as_numpy(g) for g, _ in groups],
                                                 [int(terms) for _, terms in groups], extension.default_threads(),
                                                 policy.eps)
    policy.record("gram", "cpp")
    sigmas = [torch.from_numpy(sigma) for sigma in sigmas]
    return list(zip(sigmas, metrics_of_groups(sigmas, metrics), strict=True))


def _gram_cpp(grams: torch.Tensor, eps: float, terms: int) -> torch.Tensor:
    with extension.ONE_BLAS_THREAD():
        sigma = extension.C.gram_spectra(extension.as_numpy(grams), extension.default_threads(), eps, terms)
    return torch.from_numpy(sigma)


def _gram_device(eigen: Eigensolver, grams: torch.Tensor, eps: float = EPS64, terms: int = 0) -> torch.Tensor:
    return singular_values_from_gram_eigenvalues(eigen.eigvalsh(grams.double()), eps, terms).cpu()


def core_spectra(
    B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor | None = None, policy: Policy | str = "auto",
    terms: int = 0, metrics: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B = X X^T (N, T, T) and A_j = D_j D_j^T (N, M, T, T) -> sigma (N, M, T), metrics (N, M, len(metrics)),
    on the CPU (metrics: registered names, default all).

    For any F with B = F F^T, the singular values of D_j^T X are the square roots of the
    eigenvalues of F^T A_j F. F is B's Cholesky factor (the extension's, or a batched one where B
    lies); where B is not positive definite at fp64, the pivoted Cholesky's, which drops pivots
    below max(n, terms) * eps * max (eps: the policy's precision; terms: the feature sizes the
    Grams summed over; _core_device).
    ``lengths`` (N,) are the tokens per sample: beyond them B and
    A are zero padding, which the extension skips (the device paths compute through it).
    """
    policy = Policy.of(policy)
    if lengths is None:
        lengths = torch.full((B.shape[0],), B.shape[-1], dtype=torch.int64)
    sigma = _eigen_stage("core", (B, A, lengths), policy, partial(_core_cpp, eps=policy.eps, terms=terms),
                         partial(_core_device, eps=policy.eps, terms=terms))
    return sigma, metrics_from_singular_values(sigma, metrics)


def host_core_spectra(
    groups: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, int]], policy: Policy | str = "auto",
    metrics: tuple[str, ...] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """core_spectra of several groups (B, [A_j], lengths, terms), each A_j (N, T, T) like its B, solved
    by the extension in one job over every sample of every group: a group of one or two long
    samples alone would leave threads idle. (sigma, metrics) per group, as core_spectra gives them."""
    policy = Policy.of(policy)
    with extension.ONE_BLAS_THREAD():
        sigmas = extension.C.core_spectra_groups(
            [extension.as_numpy(B) for B, _, _, _ in groups],
            [[extension.as_numpy(a) for a in A] for _, A, _, _ in groups],
            [lengths.cpu().to(torch.int64).numpy() for _, _, lengths, _ in groups],
            [int(terms) for _, _, _, terms in groups], extension.default_threads(), policy.eps)
    policy.record("core", "cpp")
    sigmas = [torch.from_numpy(sigma) for sigma in sigmas]
    return list(zip(sigmas, metrics_of_groups(sigmas, metrics), strict=True))


def _core_cpp(B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, eps: float, terms: int) -> torch.Tensor:
    with extension.ONE_BLAS_THREAD():
        sigma = extension.C.core_spectra(
            extension.as_numpy(B), extension.as_numpy(A), lengths.cpu().to(torch.int64).numpy(),
            extension.default_threads(), eps, terms,
        )
    return torch.from_numpy(sigma)


def _core_device(
    eigen: Eigensolver, B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, eps: float = EPS64, terms: int = 0
) -> torch.Tensor:
    """The core F^T A F formed where B lies: F from a batched Cholesky of B (its padding made the
    identity, which A's zero padding leaves out of the core), the core by GEMMs, its eigenvalues by
    `eigen`. A sample whose B is not positive definite at fp64 (rank-deficient: repeated inputs)
    is solved again from a rank-revealing factor: the extension's pivoted Cholesky on the host,
    else B's eigendecomposition."""
    B, A = B.double(), A.double()
    T = B.shape[-1]
    padding = torch.arange(T, device=B.device) >= to_device(lengths, B.device)[:, None]  # host lengths: no wait
    L, info = torch.linalg.cholesky_ex(B + torch.diag_embed(padding.to(B.dtype)))
    # A failed factor may hold NaN (a GPU's potrf stops at the failing pivot), which would fail the whole
    # batch's eigensolver: those samples take the identity here (no wait for the device) and are redone below.
    L = torch.where((info > 0)[:, None, None], torch.eye(T, dtype=L.dtype, device=L.device), L).unsqueeze(1)
    sigma = singular_values_from_gram_eigenvalues(eigen.eigvalsh(L.mT @ A @ L), eps, terms).cpu()
    failed = torch.nonzero(info.cpu()).flatten()  # the stage's one wait for the device
    if len(failed):
        index = failed.to(B.device)
        redo = _core_cpp if extension.BUILT else partial(_core_by_eigh, eigen)
        sigma[failed] = redo(B[index], A[index], lengths[failed.to(lengths.device)], eps=eps, terms=terms)
    return sigma


def _core_by_eigh(
    eigen: Eigensolver, B: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, eps: float = EPS64, terms: int = 0
) -> torch.Tensor:
    """F = U L^(1/2) from B's eigendecomposition, directions below the cut-off dropped: rank-revealing,
    about 25x the work of a Cholesky."""
    lam, U = eigen.eigh(B)
    keep = lam > eigenvalue_cutoff(lam, lengths.to(B.device)[:, None], eps, terms)
    F = U * torch.where(keep, lam, 0.0).sqrt().unsqueeze(-2)
    core = F.unsqueeze(1).transpose(-1, -2) @ A @ F.unsqueeze(1)
    return singular_values_from_gram_eigenvalues(eigen.eigvalsh(core), eps, terms).cpu()
