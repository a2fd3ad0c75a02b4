"""Summaries of a gradient's singular values, shared by every path (fast, fallback, reference)."""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS64 = torch.finfo(torch.float64).eps

# Below this nuclear norm the ratios are undefined: they come out NaN and the row is flagged.
ZERO_NUCLEAR_NORM = 1e-12

# A metric: sigma (..., n) -> (...), from a gradient's singular values, fp64, descending, zero-padded.
Metric = Callable[[torch.Tensor], torch.Tensor]
_METRICS: dict[str, Metric] = {}
_BUILT_IN: set[str] = set()  # METRICS, once registered below


def register_metric(name: str, metric: Metric | None = None) -> Metric | Callable[[Metric], Metric]:
    """Registers a metric of the singular values: every path (the extension, torch, CuPy, the
    reference) computes it here, and engines built after get its column "<part>/<name>". Usable as
    a decorator. Sums should run in order (``ordered_sum``), so a metric does not depend on the batch.

    Args:
        name: The column suffix: non-empty, without "/", not a built-in's (METRICS: the engine
            reads nuclear_norm to flag zero gradients). A name the user registered is replaced,
            keeping its column position.
        metric: sigma (..., n) -> (...): from a gradient's singular values (fp64, descending,
            zero-padded) to one value each. None: register the function decorated.

    Returns:
        metric itself, or without it a decorator that registers and returns the function.
    """
    if not name or "/" in name:
        raise ValueError(f"a metric's name is a non-empty column suffix without '/', got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"{name} is a built-in metric (one of {', '.join(sorted(_BUILT_IN))}), which gradspec "
                         "itself reads; register yours under another name")

    def add(fn: Metric) -> Metric:
        _METRICS[name] = fn
        return fn

    return add if metric is None else add(metric)


def metric_names() -> tuple[str, ...]:
    """The registered metrics, in column order: the built-in ones (METRICS), then the user's."""
    return tuple(_METRICS)


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension, first to last: the same rounding whatever the other dimensions."""
    return x.cumsum(-1)[..., -1] if x.shape[-1] else x.new_zeros(x.shape[:-1])


def _defined(value: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A ratio's value where the nuclear norm is not zero; NaN where it is."""
    return torch.where(ordered_sum(sigma) < ZERO_NUCLEAR_NORM, torch.nan, value)


def _spectral(sigma: torch.Tensor) -> torch.Tensor:
    return sigma.amax(-1) if sigma.shape[-1] else sigma.new_zeros(sigma.shape[:-1])


def _entropy(sigma: torch.Tensor) -> torch.Tensor:
    nuclear = ordered_sum(sigma)
    p = sigma / torch.where(nuclear < ZERO_NUCLEAR_NORM, 1.0, nuclear).unsqueeze(-1)
    return -ordered_sum(torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), 0.0))


register_metric("nuclear_norm", ordered_sum)
register_metric("effective_rank", lambda s: _defined(torch.exp(_entropy(s)), s))  # Roy & Vetterli, p = s / sum(s)
register_metric("spectral_norm", _spectral)
register_metric("frobenius_norm", lambda s: ordered_sum(s * s).sqrt())
register_metric("stable_rank", lambda s: _defined(ordered_sum(s * s) / _spectral(s).square(), s))
register_metric("sigma1_ratio", lambda s: _defined(_spectral(s) / ordered_sum(s), s))
METRICS: tuple[str, ...] = metric_names()  # the built-in ones, in column order
_BUILT_IN.update(METRICS)


def metrics_from_singular_values(sigma: torch.Tensor, names: tuple[str, ...] | None = None) -> torch.Tensor:
    """(..., n) singular values, any order, zero-padded -> (..., len(names)) in fp64, names the
    registered metrics (default: all of them, in order). Every path's metrics come from here."""
    s = sigma.to(torch.float64).clamp_min(0).sort(-1, descending=True).values
    names = metric_names() if names is None else names
    unknown = [n for n in names if n not in _METRICS]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; registered: {', '.join(_METRICS)}")
    return torch.stack([_METRICS[n](s).to(torch.float64) for n in names], dim=-1)


def metrics_of_groups(sigmas: list[torch.Tensor], names: tuple[str, ...] | None = None) -> list[torch.Tensor]:
    """metrics_from_singular_values of several sigma tensors (..., n_g) at once: zero-padded to the
    longest n (a metric's sums run in order, so trailing zeros change nothing) and computed in one set
    of torch calls instead of one per group (a batch's eigen stage has about a hundred)."""
    if not sigmas:
        return []
    n = max(s.shape[-1] for s in sigmas)
    rows = [s.reshape(s.shape[:-1].numel(), s.shape[-1]) for s in sigmas]
    flat = torch.cat([torch.nn.functional.pad(r.to(torch.float64), (0, n - r.shape[-1])) for r in rows])
    joint = metrics_from_singular_values(flat, names)
    return [m.reshape(*s.shape[:-1], joint.shape[-1]) for s, m in zip(sigmas, joint.split([len(r) for r in rows]),
                                                                    strict=True)]


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
