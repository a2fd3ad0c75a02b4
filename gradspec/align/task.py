"""The task's gradients, as the pool is compared with them: per part, K directions (see
gradspec.align.directions) and the norms the cosines divide by.

Two passes over the task examples, each one forward and backward per batch: the first takes every
example's squared gradient norm per part (and so over the model); the second builds the directions,
whose coefficients need those norms. Examples without a usable gradient (no response tokens, a
non-finite loss or gradient, a zero gradient) are left out with a warning.

Aggregates (LESS's): "mean_gradient", the cosine with the task's mean gradient; "mean" and
"max", the mean and the max of the cosines with each example's gradient. Without "max" three
directions per part suffice (the mean gradient, and the mean of the examples' gradients divided
by their part's and by their model-wide norms); with it, one per example.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradspec.align.capture import PaddedBatchHooks
from gradspec.align.directions import ROUTES, PartDirections, gram_norms2, per_sample_gradients, route_for
from gradspec.layers.targets import Part, Target

log = logging.getLogger("gradspec")
AGGREGATES = ("mean_gradient", "mean", "max")
DEFAULT_AGGREGATES = ("mean_gradient", "mean")
# A backward pass over one padded batch with these hooks: (captures, batch) -> (loss, count, finite, stats)
Pass = Callable[[list[PaddedBatchHooks], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple]


def check_aggregates(aggregates: Sequence[str] | str) -> tuple[str, ...]:
    names = tuple(a.strip() for a in aggregates.split(",")) if isinstance(aggregates, str) else tuple(aggregates)
    unknown = [a for a in names if a not in AGGREGATES]
    if unknown or not names:
        raise ValueError(f"--aggregate takes one or more of {', '.join(AGGREGATES)} (comma-separated), got "
                         f"{','.join(names) or 'nothing'}")
    return tuple(a for a in AGGREGATES if a in names)


def alignment_metrics(aggregates: Sequence[str]) -> tuple[str, ...]:
    """The per-part (and whole-model) column names of these aggregates."""
    return tuple(f"align_{a}" for a in aggregates)


@dataclass
class TaskGradients:
    """What the pool is compared with: per part, its directions; kept: which task examples count;
    model_norms2 (m,): each example's squared gradient norm over every scored part."""

    aggregates: tuple[str, ...]
    parts: dict[str, PartDirections]
    kept: torch.Tensor
    model_norms2: torch.Tensor

    @property
    def per_example(self) -> bool:
        return "max" in self.aggregates

    @property
    def metric_names(self) -> tuple[str, ...]:
        return alignment_metrics(self.aggregates)


class _Norms(PaddedBatchHooks):
    """First pass: each example's ||G_j||^2 per part, from its Grams (no G formed)."""

    def __init__(self, targets, lengths, device, dtype, rows: list[int], norms2: dict[str, torch.Tensor]):
        super().__init__(targets, lengths, device)
        self.dtype, self.rows, self.norms2 = dtype, rows, norms2

    def on_part(self, part: Part, X: torch.Tensor, D: torch.Tensor) -> None:
        for k, (row, n) in enumerate(zip(self.rows, self.lengths, strict=True)):
            self.norms2[part.name][row] = float(gram_norms2(X[k, :n].to(self.dtype), D[k, :n].to(self.dtype)))


class _Directions(PaddedBatchHooks):
    """Second pass: dense parts accumulate W += C[:, rows] G(rows); cross parts keep the rows."""

    def __init__(self, targets, lengths, device, dtype, rows: list[int], parts: dict[str, PartDirections],
                 kept_rows: dict[str, list]):
        super().__init__(targets, lengths, device)
        self.dtype, self.rows, self.parts, self.kept_rows = dtype, rows, parts, kept_rows

    def on_part(self, part: Part, X: torch.Tensor, D: torch.Tensor) -> None:
        p = self.parts[part.name]
        if p.route == "dense":
            G = per_sample_gradients(X, D, self.mask, self.dtype).flatten(1)  # (N, d_out d_in)
            C = p.coefficients[:, self.rows].to(G.device, self.dtype)
            p.W += (C @ G).view_as(p.W)
            return
        for k, (row, n) in enumerate(zip(self.rows, self.lengths, strict=True)):
            self.kept_rows[part.name].append((row, X[k, :n].to(self.dtype), D[k, :n].to(self.dtype)))


def collect_task(
    backward_pass: Pass, targets: list[Target], batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    aggregates: Sequence[str] | str = DEFAULT_AGGREGATES, dtype: torch.dtype = torch.float64, route: str = "auto",
) -> TaskGradients:
    """The task's directions from right-padded batches of its examples (in order: example j is the
    j-th row over all batches). route: "auto" (route_for, per part), or "dense" or "cross" for all."""
    aggregates = check_aggregates(aggregates)
    if route not in ("auto", *ROUTES):
        raise ValueError(f"route must be 'auto', 'dense' or 'cross', got {route!r}")
    parts = [p for t in targets for p in t.parts]
    m = sum(len(b[0]) for b in batches)
    device = batches[0][0].device if batches else "cpu"
    norms2 = {p.name: torch.full((m,), float("nan"), dtype=torch.float64) for p in parts}
    usable = torch.zeros(m, dtype=torch.bool)
    start = 0
    for batch in batches:
        rows = list(range(start, start + len(batch[0])))
        start += len(rows)
        lengths = batch[1].sum(1).cpu()
        _, _, finite, _ = backward_pass([_Norms(targets, lengths, device, dtype, rows, norms2)], batch)
        usable[rows] = finite.cpu()
    model_norms2 = torch.stack([norms2[p.name] for p in parts]).sum(0) if parts else torch.zeros(m)
    kept = usable & torch.isfinite(model_norms2) & (model_norms2 > 0)
    if not kept.any():
        raise ValueError(f"none of the {m} task examples has a usable gradient (response tokens, a finite "
                         "loss, a nonzero finite gradient): check the task file and the template")
    if not kept.all():
        log.warning("task examples %s have no usable gradient (no response tokens, non-finite or zero); "
                    "left out", torch.nonzero(~kept).flatten().tolist())
    task_tokens = sum(int(b[1][k].sum()) for b in batches for k in range(len(b[0])))
    directions = {p.name: _part_directions(p, norms2[p.name], model_norms2, kept, aggregates, task_tokens, dtype,
                                           device, route) for p in parts}
    kept_rows: dict[str, list] = {name: [] for name, d in directions.items() if d.route == "cross"}
    start = 0
    for batch in batches:
        rows = list(range(start, start + len(batch[0])))
        start += len(rows)
        lengths = batch[1].sum(1).cpu()
        backward_pass([_Directions(targets, lengths, device, dtype, rows, directions, kept_rows)], batch)
    for name, d in directions.items():
        if d.route == "cross":
            rows = [r for r in kept_rows[name] if kept[r[0]]]
            d.X, d.D = torch.cat([x for _, x, _ in rows]), torch.cat([dd for _, _, dd in rows])
            d.owner = torch.cat([torch.full((len(x),), j, dtype=torch.long) for j, x, _ in rows]).to(d.X.device)
            mean = (kept.double() / int(kept.sum())).to(d.X.device, dtype)
            d.mean_norm2 = float(mean @ d.task_inner() @ mean)
        elif "max" in aggregates:
            d.mean_norm2 = float(d.W.mean(0).pow(2).sum())
        else:
            d.mean_norm2 = float(d.W[0].pow(2).sum())
    return TaskGradients(aggregates, directions, kept, model_norms2)


def _part_directions(part: Part, norms2: torch.Tensor, model_norms2: torch.Tensor, kept: torch.Tensor,
                     aggregates: tuple[str, ...], task_tokens: int, dtype: torch.dtype, device, route: str,
                     ) -> PartDirections:
    """The coefficients C (K, m): one row per kept example with "max"; else the mean gradient and the
    means of the examples' gradients over their part's norm (zero-norm examples out) and over their
    model-wide norm."""
    m = len(norms2)
    if "max" in aggregates:
        C = torch.eye(m, dtype=torch.float64)[kept]
    else:
        in_part = kept & (norms2 > 0)
        C = torch.stack([
            kept.double() / int(kept.sum()),
            torch.where(in_part, 1 / (max(int(in_part.sum()), 1) * norms2.sqrt()), 0.0),  # fp64: norms2's
            torch.where(kept, 1 / (int(kept.sum()) * model_norms2.sqrt()), 0.0),
        ])
    if route == "auto":
        route = route_for(part.d_in, part.d_out, task_tokens, C.shape[0])
    d = PartDirections(route, C, norms2)
    if route == "dense":
        d.W = torch.zeros(C.shape[0], part.d_out, part.d_in, dtype=dtype, device=device)
    return d
