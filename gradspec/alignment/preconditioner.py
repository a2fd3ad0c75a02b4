"""What align applies to gradients before it compares them: per part, either a task-side inverse
curvature (K-FAC, EK-FAC: gradspec.alignment.kfac) or a pool-side update map (Adam:
gradspec.alignment.adam). With none, align compares plain gradients."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Preconditioner:
    """kind: one of gradspec.choices.PRECONDITIONERS; parts: part name -> its map; described: what the score file's
    metadata records (how it was fitted or read)."""

    kind: str
    parts: dict[str, object]
    described: dict = field(default_factory=dict)

    @property
    def kronecker(self) -> bool:
        """Whether the task's own rows can carry it (K-FAC): then the cross route stays available."""
        return self.kind == "kfac"

    def task_side(self, name: str):
        """The part's map of the task's gradients (task_gradient, and task_rows where Kronecker), or None."""
        return None if self.kind in ("none", "adam") else self.parts[name]

    def pool_side(self, name: str):
        """The part's map of each pool sample's gradient, G (n, d_out, d_in) -> (n, d_out, d_in), or None."""
        return self.parts[name].pool_gradient if self.kind == "adam" else None

    def task_norm2(self, name: str, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """||P(d^T x)||_F^2 for one task example's valid rows in this part."""
        from gradspec.alignment.directions import gram_norms2

        side = self.task_side(name)
        if side is None:
            return gram_norms2(x, d)
        if self.kronecker:
            return gram_norms2(*side.task_rows(x, d))
        return side.task_gradient((d.T @ x)[None])[0].pow(2).sum()

    def describe(self) -> dict:
        return {"preconditioner": self.kind, **self.described}
