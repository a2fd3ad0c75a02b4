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


def singular_values_from_gram_eigenvalues(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of G G^T (any order) -> singular values of G, descending.

    Eigenvalues below n * eps * max are rounding noise of the Gram and count as zero.
    """
    lam = eigenvalues.to(torch.float64)
    n = lam.shape[-1]
    cutoff = n * torch.finfo(torch.float64).eps * lam.amax(-1, keepdim=True).clamp_min(0)
    return torch.where(lam > cutoff, lam, 0.0).sqrt().sort(dim=-1, descending=True).values
