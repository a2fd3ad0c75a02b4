"""Cosines between each pool sample's gradient and the task's, per part and over the whole scored
model, from the inner products and squared norms the capture gives (see gradspec.alignment.task)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gradspec.alignment.task import TaskGradients


def _nanmax(x: torch.Tensor) -> torch.Tensor:
    """Max over the last dimension ignoring NaN; NaN where all are."""
    top = torch.where(torch.isnan(x), -torch.inf, x).amax(-1)
    return torch.where(torch.isnan(x).all(-1), torch.nan, top)


def _aggregate(cos: torch.Tensor, mean_gradient: torch.Tensor, aggregates: tuple[str, ...]) -> torch.Tensor:
    """(N, K) cosines with each example, (N,) with the mean gradient -> (N, len(aggregates))."""
    found = {"mean_gradient": mean_gradient, "mean": cos.nanmean(-1), "max": _nanmax(cos)}
    return torch.stack([found[a] for a in aggregates], -1)


def cosines(task: TaskGradients, results: dict[str, tuple[torch.Tensor, torch.Tensor]], samples: int
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """results[part] = (<G_i, W_k> (N, K), ||G_i||^2 (N,)) -> ({part: (N, A)}, whole model (N, A),
    attribution), A = len(task.aggregates), fp64 on the CPU; NaN where a norm is zero or not finite,
    and everywhere when nothing was captured (no sample of the batch had a loss). attribution (with
    task.attribution, else None): (N, width) whole-model inner products with each task example's
    gradient, NaN for the examples (or task file rows) left out (TaskGradients.attribution_columns)."""
    attribution = None
    if task.attribution:
        width, positions = task.attribution_columns()
        attribution = torch.full((samples, width), torch.nan, dtype=torch.float64)
    if not results:
        nan = torch.full((samples, len(task.aggregates)), torch.nan, dtype=torch.float64)
        return {name: nan.clone() for name in task.parts}, nan, attribution
    results = {name: (inner.double().cpu(), n2.double().cpu()) for name, (inner, n2) in results.items()}
    per_part = {}
    model_inner = sum(inner for inner, _ in results.values())
    model_n2 = sum(n2 for _, n2 in results.values())
    mean_norm2 = sum(task.parts[name].mean_norm2 for name in results)
    for name, (inner, n2) in results.items():
        d = task.parts[name]
        if task.per_example:
            n2_j = d.norms2[task.kept]
            cos = inner / (n2[:, None] * n2_j[None, :]).sqrt()
            cos = torch.where(n2_j[None, :] > 0, cos, torch.nan)
            per_part[name] = _aggregate(cos, inner.mean(1) / (n2 * d.mean_norm2).sqrt(), task.aggregates)
        else:
            found = {"mean_gradient": inner[:, 0] / (n2 * d.mean_norm2).sqrt(), "mean": inner[:, 1] / n2.sqrt()}
            per_part[name] = torch.stack([found[a] for a in task.aggregates], -1)
    if task.attribution:
        attribution[:, positions] = model_inner
    if task.per_example:
        cos = model_inner / (model_n2[:, None] * task.model_norms2[task.kept][None, :]).sqrt()
        model = _aggregate(cos, model_inner.mean(1) / (model_n2 * mean_norm2).sqrt(), task.aggregates)
    else:
        found = {"mean_gradient": model_inner[:, 0] / (model_n2 * mean_norm2).sqrt(),
                 "mean": model_inner[:, 2] / model_n2.sqrt()}
        model = torch.stack([found[a] for a in task.aggregates], -1)
    return per_part, model, attribution


def projected_cosines(pool: torch.Tensor, task: torch.Tensor, part_names: list[str], aggregates: tuple[str, ...]
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same cosines from projected gradients (gradspec.alignment.projection): pool (N, dims) and
    task (m, dims), each part's block of dims/len(part_names) in order -> ({part: (N, A)}, (N, A)).
    Estimates: inner products and norms are those of the projections (task rows: usable ones,
    see gradspec.runs.store_query.task_vectors)."""
    pool, task = pool.double(), task.double()
    width = pool.shape[1] // len(part_names)

    def aggregated(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nu, nv = u.norm(dim=1), v.norm(dim=1)
        cos = (u @ v.T) / (nu[:, None] * nv[None, :])
        cos = torch.where(nv[None, :] > 0, cos, torch.nan)
        mean = v.mean(0)
        return _aggregate(cos, (u @ mean) / (nu * mean.norm()), aggregates)

    per_part = {name: aggregated(pool[:, k * width : (k + 1) * width], task[:, k * width : (k + 1) * width])
                for k, name in enumerate(part_names)}
    return per_part, aggregated(pool, task)


def flag_alignment(
    per_part: dict[str, torch.Tensor], model: torch.Tensor, finite: torch.Tensor, flags: list[set[str]],
    routed: set[str] = frozenset(),
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """NaN for samples without a loss; a scored sample with a NaN cosine is flagged
    alignment_undefined (a zero or non-finite gradient, or a part where the task's is zero), except
    in a routed part (an expert the sample or the task did not reach)."""
    unscored = ~finite
    per_part = {p: torch.where(unscored[:, None], torch.nan, v) for p, v in per_part.items()}
    model = torch.where(unscored[:, None], torch.nan, model)
    undefined = torch.isnan(model).any(1)
    for name, v in per_part.items():
        if name not in routed:
            undefined |= torch.isnan(v).any(1)
    for i in torch.nonzero(undefined & finite).flatten().tolist():
        flags[i].add("alignment_undefined")
    return per_part, model
