"""The pool's capture: per scored part, each sample's inner products with the task's directions
and its squared gradient norm, as the part's output gradient arrives."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gradspec.alignment.cosines import cosines, flag_alignment
from gradspec.alignment.kept_capture import KeptCapture
from gradspec.layers.hooks import BatchLayout, Captured
from gradspec.layers.registry import Part, Target

if TYPE_CHECKING:
    from gradspec.alignment.task import TaskGradients


class AlignmentCapture(KeptCapture):
    """A pool batch against one task (kept with the batch, so a later set_task does not change it):
    per part, kept[part] = (<G_i, W_k> (N, K), ||G_i||^2 (N,)) at dtype; zero where a sample did not
    reach the part (a routed one)."""

    def __init__(self, targets: list[Target], batch: BatchLayout, task: TaskGradients, dtype: torch.dtype) -> None:
        super().__init__(targets, batch)
        self.task, self.dtype = task, dtype

    def on_part(self, part: Part, captured: Captured) -> None:
        directions = self.task.parts[part.name]
        inner, norms2 = directions.inner(captured.X, captured.D, captured.mask, captured.lengths.tolist(), self.dtype)
        unreached = directions.unreached() if part.routed else None
        fills = (None, None) if unreached is None else unreached
        self.kept[part.name] = (captured.scatter(inner, fills[0]), captured.scatter(norms2, fills[1]))

    def finish(self, scores) -> None:
        missed = [p.name for t in self.targets for p in t.parts if p.routed and p.name not in self.kept]
        for name in missed if self.kept else ():  # routed parts no sample of the batch reached
            unreached = self.task.parts[name].unreached()
            if unreached is not None:
                self.kept[name] = tuple(v.cpu().expand(self.batch.N, *v.shape) for v in unreached)
        per_part, model, attribution = cosines(self.task, self.kept, self.batch.N)
        routed = {p.name for t in self.targets for p in t.parts if p.routed}
        per_part, model = flag_alignment(per_part, model, scores.scored, scores.flags, routed)
        if attribution is not None:
            scores.attribution = torch.where(scores.scored[:, None], attribution, torch.nan)
        scores.metrics = {p: torch.cat([scores.metrics[p], v], 1) if p in scores.metrics else v
                          for p, v in per_part.items()}
        scores.alignment = dict(zip(self.task.metric_names, model.unbind(1), strict=True))
