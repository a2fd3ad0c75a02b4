"""The task's gradients, as the pool is compared with them: per part, K directions (see
gradspec.alignment.directions) and the norms the cosines divide by.

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
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradspec.alignment.batches import numbered
from gradspec.alignment.directions import (
    ROUTES,
    PartDirections,
    held_values,
    per_sample_gradients,
    route_for,
)
from gradspec.alignment.kept_capture import KeptCapture
from gradspec.alignment.preconditioner import Preconditioner
from gradspec.choices import DEFAULT_AGGREGATES, check_aggregates
from gradspec.layers.hooks import BatchLayout, Captured
from gradspec.layers.registry import Part, Target
from gradspec.linalg.host_copies import to_device

log = logging.getLogger("gradspec")
# A backward pass over one padded batch with these hooks: (captures, batch) -> (loss, count, finite, stats)
Pass = Callable[[list[KeptCapture], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple]


def alignment_metrics(aggregates: Sequence[str]) -> tuple[str, ...]:
    """The per-part (and whole-model) column names of these aggregates."""
    return tuple(f"align_{a}" for a in aggregates)


@dataclass
class TaskGradients:
    """What the pool is compared with: per part, its directions; kept: which task examples count;
    model_norms2 (m,): each example's squared gradient norm over every scored part (preconditioned,
    where the preconditioner is task-side); attribution: each pool sample's inner product with every
    kept example's gradient is kept too (BatchScores.attribution)."""

    aggregates: tuple[str, ...]
    parts: dict[str, PartDirections]
    kept: torch.Tensor
    model_norms2: torch.Tensor
    attribution: bool = False
    preconditioner: Preconditioner | None = None
    example_rows: tuple[list[int], int] | None = None  # (the file row of each example, the file's rows)

    def attribution_columns(self) -> tuple[int, torch.Tensor]:
        """(width, positions): the attribution's width (the task file's rows, else its examples) and
        where each kept example's values go in it."""
        if self.example_rows is None:
            return len(self.kept), torch.nonzero(self.kept).flatten()
        rows, width = self.example_rows
        return width, torch.tensor(rows, dtype=torch.long)[self.kept]

    @property
    def per_example(self) -> bool:
        """One direction per kept example (the max aggregate and the attribution need them)."""
        return "max" in self.aggregates or self.attribution

    @property
    def metric_names(self) -> tuple[str, ...]:
        return alignment_metrics(self.aggregates)


class _Norms(KeptCapture):
    """First pass: each example's ||G_j||^2 per part (preconditioned where the task side is), from its
    Grams where it can be (no G formed), read once at the end; and its tokens there (an expert's: those
    routed to it), which the cross route would hold."""

    def __init__(self, targets, batch: BatchLayout, dtype, rows: list[int], norms2: dict[str, dict[int, torch.Tensor]],
                 tokens: dict[str, dict[int, int]], preconditioner: Preconditioner):
        super().__init__(targets, batch)
        self.dtype, self.rows, self.preconditioner = dtype, rows, preconditioner
        self.norms2, self.tokens = norms2, tokens

    def on_part(self, part: Part, captured: Captured) -> None:
        for k, n in enumerate(captured.lengths.tolist()):
            x, d = captured.X[k, :n].to(self.dtype), captured.D[k, :n].to(self.dtype)
            example = self.rows[captured.batch_row(k)]
            self.norms2[part.name][example] = self.preconditioner.task_norm2(part.name, x, d)
            self.tokens[part.name][example] = n


class _Directions(KeptCapture):
    """Second pass, over the kept examples only (another's NaN would spread through a sum even
    at coefficient 0): dense parts accumulate W += C[:, examples] G(examples); cross parts keep the rows."""

    def __init__(self, targets, batch: BatchLayout, dtype, rows: list[int], kept: torch.Tensor,
                 parts: dict[str, PartDirections], kept_rows: dict[str, list], preconditioner: Preconditioner):
        super().__init__(targets, batch)
        self.dtype, self.parts, self.kept_rows = dtype, parts, kept_rows
        self.rows, self.kept_examples, self.preconditioner = rows, kept, preconditioner

    def on_part(self, part: Part, captured: Captured) -> None:
        p = self.parts[part.name]
        examples = [self.rows[captured.batch_row(k)] for k in range(len(captured.lengths))]
        local = [k for k, example in enumerate(examples) if self.kept_examples[example]]
        examples = [examples[k] for k in local]
        if not local:
            return
        p.follow(captured.X.device)
        side = self.preconditioner.task_side(part.name)
        if p.route == "dense":
            take = to_device(torch.tensor(local), captured.X.device)
            G = per_sample_gradients(captured.X[take], captured.D[take], captured.mask[take], self.dtype)
            G = (G if side is None else side.task_gradient(G)).flatten(1)
            p.W += (p.device_coefficients[:, examples] @ G).view_as(p.W)
            return
        for k, example in zip(local, examples, strict=True):
            n = int(captured.lengths[k])  # copies: a view would keep the whole padded (fused) tensor alive
            x, d = captured.X[k, :n].to(self.dtype, copy=True), captured.D[k, :n].to(self.dtype, copy=True)
            self.kept_rows[part.name].append((example, *((x, d) if side is None else side.task_rows(x, d))))


def collect_task(
    backward_pass: Pass, targets: list[Target], batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    aggregates: Sequence[str] | str = DEFAULT_AGGREGATES, dtype: torch.dtype = torch.float64, route: str = "auto",
    budget_bytes: int | None = None, preconditioner: Preconditioner | None = None, attribution: bool = False,
    example_rows: tuple[list[int], int] | None = None, progress: bool = False,
) -> TaskGradients:
    """The task's directions from right-padded batches of its examples (in order: example j is the
    j-th row over all batches). route: "auto" (route_for, per part, within budget_bytes of held
    directions: default GRADSPEC_TASK_BYTES or 8 GiB), or "dense" or "cross" for all; a preconditioner
    that is not Kronecker (EK-FAC, Adam) needs each G formed: dense for all. attribution: one direction
    per example, and each pool sample's inner product with each kept, laid out over the task file's rows
    where example_rows gives them ((the file row of each example, the file's rows); NaN for rows left out).
    progress: a bar for each pass over the task's examples."""
    aggregates = check_aggregates(aggregates)
    if route not in ("auto", *ROUTES):
        raise ValueError(f"route must be 'auto', 'dense' or 'cross', got {route!r}")
    preconditioner = preconditioner or Preconditioner("none", {})
    if preconditioner.kind not in ("none", "kfac"):
        if route == "cross":
            raise ValueError(f"the {preconditioner.kind} preconditioner needs each gradient formed: route 'dense'")
        route = "dense"
    parts = [p for t in targets for p in t.parts]
    m = sum(len(b[0]) for b in batches)
    device = batches[0][0].device if batches else torch.device("cpu")
    found: dict[str, dict[int, torch.Tensor]] = {p.name: {} for p in parts}
    tokens: dict[str, dict[int, int]] = {p.name: {} for p in parts}
    usable = torch.zeros(m, dtype=torch.bool)
    for rows, batch in numbered(batches, "task gradients", progress):
        layout = BatchLayout(batch[1].sum(1).cpu(), device)
        _, _, finite, _ = backward_pass([_Norms(targets, layout, dtype, rows, found, tokens, preconditioner)], batch)
        usable[rows] = finite.cpu()
    # An example a part never saw has no gradient there: a routed part (an expert) it did not reach,
    # or any part where it had no loss (then it is not usable anyway).
    norms2 = {name: torch.tensor([float(v[j]) if j in v else 0.0 for j in range(m)], dtype=torch.float64)
              for name, v in found.items()}
    model_norms2 = torch.stack([norms2[p.name] for p in parts]).sum(0) if parts else torch.zeros(m)
    kept = usable & torch.isfinite(model_norms2) & (model_norms2 > 0)
    if not kept.any():
        raise ValueError(f"none of the {m} task examples has a usable gradient (response tokens, a finite "
                         "loss, a nonzero finite gradient): check the task file and the template")
    if not kept.all():
        log.warning("task examples %s have no usable gradient (no response tokens, non-finite or zero); "
                    "left out", torch.nonzero(~kept).flatten().tolist())
    # the task tokens each part's cross route would hold: every kept example's, an expert's routed ones alone
    task_tokens = {name: sum(n for j, n in v.items() if kept[j]) for name, v in tokens.items()}
    per_example = "max" in aggregates or attribution
    coefficients = {p.name: _coefficients(norms2[p.name], model_norms2, kept, per_example) for p in parts}
    routes = _routes(parts, {n: len(c) for n, c in coefficients.items()}, task_tokens, route,
                     torch.finfo(dtype).bits // 8, budget_bytes)
    directions = {}
    for p in parts:
        C = coefficients[p.name]
        d = directions[p.name] = PartDirections(routes[p.name], C, norms2[p.name],
                                                device_coefficients=C.to(device, dtype),
                                                pool_gradient=preconditioner.pool_side(p.name))
        if d.route == "dense":  # a NaN coefficient row (no example reached the part) is a NaN direction, as on cross
            d.W = torch.zeros(len(C), p.d_out, p.d_in, dtype=dtype, device=device)
            d.W[torch.isnan(C).any(1).to(device)] = torch.nan
    kept_rows: dict[str, list] = {name: [] for name, d in directions.items() if d.route == "cross"}
    for rows, batch in numbered(batches, "task directions", progress and bool(kept_rows)):
        if kept[rows].any():
            layout = BatchLayout(batch[1].sum(1).cpu(), device)
            backward_pass([_Directions(targets, layout, dtype, rows, kept, directions, kept_rows, preconditioner)],
                          batch)
    mean = (kept.double() / int(kept.sum())).to(device, dtype)
    shapes = {p.name: (p.d_in, p.d_out) for p in parts}
    for name, d in directions.items():
        if d.route == "cross":
            # no rows where no kept example reached the part (an expert): a zero task gradient there, as on the
            # dense route (whose W rows are zero, or NaN where the coefficients are)
            rows = kept_rows[name] or [(0, *(torch.zeros(0, n, dtype=dtype, device=device) for n in shapes[name]))]
            d.X, d.D = torch.cat([x for _, x, _ in rows]), torch.cat([dd for _, _, dd in rows])
            d.owner = torch.cat([torch.full((len(x),), j, dtype=torch.long) for j, x, _ in rows]).to(d.X.device)
            inner = d.task_inner()
            d.mean_norm2 = float(mean.to(inner.device) @ inner @ mean.to(inner.device))
        elif per_example:
            d.mean_norm2 = float(d.W.mean(0).pow(2).sum())
        else:
            d.mean_norm2 = float(d.W[0].pow(2).sum())
    return TaskGradients(aggregates, directions, kept, model_norms2, attribution,
                         None if preconditioner.kind == "none" else preconditioner, example_rows)


def _coefficients(norms2: torch.Tensor, model_norms2: torch.Tensor, kept: torch.Tensor,
                  per_example: bool) -> torch.Tensor:
    """C (K, m), fp64: one row per kept example where per_example; else the mean gradient, and the means
    of the examples' gradients over their part's norm (zero-norm examples out: NaN where none is left)
    and over their model-wide norm."""
    m = len(norms2)
    if per_example:
        return torch.eye(m, dtype=torch.float64)[kept]
    in_part = kept & (norms2 > 0)
    count = int(in_part.sum())
    return torch.stack([
        kept.double() / int(kept.sum()),
        torch.where(in_part, 1 / (count * norms2.sqrt()), 0.0) if count else torch.full((m,), torch.nan,
                                                                                           dtype=torch.float64),
        torch.where(kept, 1 / (int(kept.sum()) * model_norms2.sqrt()), 0.0),
    ])


def _routes(parts: list[Part], directions: dict[str, int], task_tokens: dict[str, int], route: str, itemsize: int,
            budget_bytes: int | None) -> dict[str, str]:
    """Each part's route: the one given, or the cheaper one for its task tokens, moved to cross part by part
    where that holds less (those that save the most first) while the directions would not fit in the budget."""
    if route != "auto":
        return {p.name: route for p in parts}
    budget = budget_bytes if budget_bytes is not None else int(os.environ.get("GRADSPEC_TASK_BYTES", 8 * 2**30))
    routes = {p.name: route_for(p.d_in, p.d_out, task_tokens[p.name], directions[p.name]) for p in parts}

    def held(p: Part, r: str) -> int:
        return held_values(r, p.d_in, p.d_out, task_tokens[p.name], directions[p.name]) * itemsize

    total = sum(held(p, routes[p.name]) for p in parts)
    for p in sorted((p for p in parts if routes[p.name] == "dense" and held(p, "cross") < held(p, "dense")),
                    key=lambda p: held(p, "cross") - held(p, "dense")):
        if total <= budget:
            break
        total += held(p, "cross") - held(p, "dense")
        routes[p.name] = "cross"
    if total > budget:
        raise ValueError(f"the task's directions would hold {total / 2**30:.1f} GiB (budget {budget / 2**30:.1f} "
                         "GiB, GRADSPEC_TASK_BYTES): use fewer or shorter task examples, fewer modules, no 'max' "
                         "aggregate, or a projected store (gradspec project, align --store)")
    return routes
