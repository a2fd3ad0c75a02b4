"""Summaries of a gradient's singular values, shared by every path (fast, fallback, reference)."""

from __future__ import annotations

import torch

# Column order of every metrics array; csrc/spectral.cpp writes the same order.
METRICS: tuple[str, ...] = (
    "nuclear_norm",
    "effective_rank",
    "spectral_norm",
    "frobenius_norm",
    "stable_rank",
    "sigma1_ratio",
)

EPS64 = torch.finfo(torch.float64).eps

# Below this nuclear norm the ratios are undefined: they come out NaN and the row is flagged.
ZERO_NUCLEAR_NORM = 1e-12


def metrics_from_singular_values(sigma: torch.Tensor) -> torch.Tensor:
    """(..., n) singular values, any order, zero-padded -> (..., len(METRICS)) in fp64.

    effective_rank is Roy & Vetterli's exp(-sum p ln p), p = sigma / sum(sigma), over p > 0.
    """
    s = sigma.to(torch.float64).clamp_min(0)
    nuclear = s.sum(-1)
    spectral = s.amax(-1) if s.shape[-1] else torch.zeros_like(nuclear)
    frob2 = (s * s).sum(-1)
    zero = nuclear < ZERO_NUCLEAR_NORM
    p = s / torch.where(zero, 1.0, nuclear).unsqueeze(-1)
    entropy = -torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), 0.0).sum(-1)
    nan = torch.full_like(nuclear, float("nan"))
    return torch.stack(
        [
            nuclear,
            torch.where(zero, nan, torch.exp(entropy)),
            spectral,
            frob2.sqrt(),
            torch.where(zero, nan, frob2 / spectral.square()),
            torch.where(zero, nan, spectral / nuclear),
        ],
        dim=-1,
    )


def metrics_dict(row: torch.Tensor, names: tuple[str, ...] = METRICS) -> dict[str, float]:
    """One metrics row -> {metric name: value}."""
    return dict(zip(names, row.tolist(), strict=True))


def eigenvalue_cutoff(lam: torch.Tensor, n: int | torch.Tensor, eps: float = EPS64, terms: int = 0) -> torch.Tensor:
    """max(n, terms) * eps * max(lam): below it, an eigenvalue of an n x n Gram whose entries are
    sums of `terms` products formed at precision eps is that Gram's rounding, not spectrum (a
    sum of k products is off by up to k * eps of its size). The rule of csrc/spectral.cpp too."""
    return torch.clamp(torch.as_tensor(n), min=terms) * eps * lam.amax(-1, keepdim=True).clamp_min(0)


def singular_values_from_gram_eigenvalues(
    eigenvalues: torch.Tensor, eps: float = EPS64, terms: int = 0
) -> torch.Tensor:
    """Eigenvalues of G G^T (any order) -> singular values of G, descending; eigenvalues below
    the cut-off count as zero."""
    lam = eigenvalues.to(torch.float64)
    return torch.where(lam > eigenvalue_cutoff(lam, lam.shape[-1], eps, terms), lam, 0.0).sqrt().sort(
        dim=-1, descending=True).values
