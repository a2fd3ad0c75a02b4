"""Approximate top-k spectra without materialising G: a randomized range finder on G = D^T X.

Halko, Martinsson & Tropp (2011), algorithm 4.4: sketch Y = G Omega = D^T (X Omega), refine with
power iterations, then take the singular values of the small k x d_in matrix Q^T G = (D Q)^T X
(from its k x k Gram, in the eigen stage: the hooks never wait for the device).
The top singular values (so the spectral norm) come out close to exact; the nuclear norm and the
effective rank see only the top k and are biased low (measured on SmolLM2 in benchmarks/RESULTS.md),
which is why this mode is opt-in and never the default. ||G||_F is exact, so the stable rank is
too, and ``topk_energy`` (sum of the top-k sigma^2 over ||G||_F^2) says how much the top k hold.
Every product over tokens is a per-sample A^T B (``spectral.segment_tdot``) at the policy's
precision (gradspec.linalg.policy); the small factorisations are always fp64.
"""

from __future__ import annotations

import torch

from gradspec.linalg.grams import segment_gram, segment_tdot
from gradspec.linalg.metrics import (
    metric_names,
    metrics_from_singular_values,
    ordered_sum,
    singular_values_from_gram_eigenvalues,
)
from gradspec.linalg.policy import Policy

TOPK_ENERGY = "topk_energy"


def lowrank_metric_names() -> tuple[str, ...]:
    """The low-rank method's columns: every registered metric (of the top-k sigma), then topk_energy."""
    return metric_names() + (TOPK_ENERGY,)


LOWRANK_METRICS: tuple[str, ...] = lowrank_metric_names()  # with the built-in metrics
OVERSAMPLING = 8  # extra sketch columns beyond the rank kept: sharper top-k at little cost


def sketch_matrix(d_in: int, d_out: int, rank: int, seed: int) -> torch.Tensor:
    """The Gaussian Omega (d_in, k) for one module: fixed by the seed, so a sample's result does
    not depend on its batch."""
    k = min(rank + OVERSAMPLING, d_in, d_out)
    return torch.randn(d_in, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sketch_gram(
    X: torch.Tensor, D: torch.Tensor, lengths: torch.Tensor, omega: torch.Tensor, power_iters: int,
    policy: Policy | str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """X (N, T, d_in), D (N, T, d_out), omega (d_in, k), lengths on X's device -> the Gram P P^T (N, k, k)
    of each P = Q^T D_i^T X_i (whose singular values are the sketch's: sketch_singular_values) and the
    exact ||D_i^T X_i||_F^2 (N,), in fp64, on X's device. Nothing here waits for the device (the hooks
    call it; an SVD there would: cuSOLVER's status is read back), so the k x k eigenproblems are left to
    the eigen stage."""
    policy = Policy.of(policy)
    wide = policy.dtype
    X, D = X.to(wide), D.to(wide)

    def tdot(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return segment_tdot(A, B, lengths, policy).double()

    Y = tdot(D, X @ omega.to(X))  # G Omega = D^T (X Omega): (N, d_out, k)
    for _ in range(power_iters):
        Y = torch.linalg.qr(Y).Q
        Z = torch.linalg.qr(tdot(X, D @ Y.to(wide))).Q  # G^T Y = X^T (D Y): (N, d_in, k)
        Y = tdot(D, X @ Z.to(wide))
    Q = torch.linalg.qr(Y).Q
    P = tdot(D @ Q.to(wide), X)  # Q^T G = (D Q)^T X: (N, k, d_in)
    if X.shape[1] < min(X.shape[-1], D.shape[-1]):  # ||G||_F^2 = <D D^T, X X^T>, cheaper than G when T is small
        frob2 = segment_gram(D, lengths, segment_gram(X, lengths, policy=policy)[0], policy)[1].double()
    else:
        frob2 = tdot(D, X).square().sum((1, 2))
    return P @ P.mT, frob2


def sketch_singular_values(gram: torch.Tensor, rank: int, eps: float, terms: int) -> torch.Tensor:
    """(N, k, k) Grams from sketch_gram (finite) -> the top-`rank` singular values of each sketch, (N, rank)
    descending: square roots of the Gram's eigenvalues, those below the exact path's cut-off (its
    rounding: eps the products' precision, terms the d_in they summed over) zero."""
    return singular_values_from_gram_eigenvalues(torch.linalg.eigvalsh(gram), eps, terms)[:, :rank]


def lowrank_metrics(sigma: torch.Tensor, frob2: torch.Tensor, names: tuple[str, ...] | None = None
                    ) -> torch.Tensor:
    """(N, rank) top singular values and exact ||G||_F^2 -> (N, len(names)), names as lowrank_metric_names():
    each metric of the top-k sigma, except the Frobenius norm and the stable rank, which are exact."""
    names = lowrank_metric_names() if names is None else names
    spectra = tuple(n for n in names if n != TOPK_ENERGY)
    m = dict(zip(spectra, metrics_from_singular_values(sigma, spectra).unbind(-1), strict=True))
    spectral = sigma.double().amax(-1)
    exact = {"frobenius_norm": frob2.sqrt(), "stable_rank": frob2 / spectral.square(),
             TOPK_ENERGY: ordered_sum(sigma.double().square()) / frob2}
    return torch.stack([exact[n] if n in exact else m[n] for n in names], dim=1)
