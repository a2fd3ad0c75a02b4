"""A Kronecker-factored random projection of each part's per-sample gradient, for stores that
later runs query without the model's backward over the pool.

Per part, P_in (d_in x k_in) and P_out (d_out x k_out) have independent N(0, 1/k) entries, so
E[P P^T] = I and <P_out^T G P_in, P_out^T G' P_in> is an unbiased estimate of <G, G'>. The
projection (D P_out)^T (X P_in) never forms G: T (d_in k_in + d_out k_out + k_in k_out) per sample.
The matrices come from the seed and the part's position, so a store and a later query agree.
"""

from __future__ import annotations

import torch

from gradspec.alignment.directions import masked
from gradspec.alignment.kept_capture import KeptCapture
from gradspec.layers.hooks import BatchLayout, Captured
from gradspec.layers.registry import Part, Target
from gradspec.options import OptionError, mention


class KroneckerProjection:
    """P_in and P_out per part, made on first use on the device asked for (seeded, fp64 on the host)."""

    def __init__(self, parts: list[Part], k_in: int, k_out: int, seed: int = 0) -> None:
        if k_in < 1 or k_out < 1:
            raise ValueError(f"projection sizes must be >= 1, got k_in={k_in}, k_out={k_out}")
        smallest = min(min(p.d_in, p.d_out) for p in parts)
        if max(k_in, k_out) > smallest:
            raise OptionError("project", f"{max(k_in, k_out)} is more than the smallest scored module's size "
                              f"({smallest}): a projection larger than the gradient itself; use "
                              f"{mention('project')} {smallest} or less")
        self.parts, self.k_in, self.k_out, self.seed = list(parts), k_in, k_out, seed
        self._position = {p.name: i for i, p in enumerate(self.parts)}
        self._matrices: dict[tuple[str, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dims(self) -> int:
        """Values per sample: k_out k_in per part, parts in order."""
        return len(self.parts) * self.k_in * self.k_out

    def describe(self) -> dict:
        return {"k_in": self.k_in, "k_out": self.k_out, "seed": self.seed, "parts": [p.name for p in self.parts]}

    def matrices(self, part: Part, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (part.name, torch.device(device), dtype)
        if key not in self._matrices:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._position[part.name])
            p_in = torch.randn(part.d_in, self.k_in, generator=g, dtype=torch.float64) / self.k_in ** 0.5
            p_out = torch.randn(part.d_out, self.k_out, generator=g, dtype=torch.float64) / self.k_out ** 0.5
            self._matrices[key] = (p_in.to(device, dtype), p_out.to(device, dtype))
        return self._matrices[key]

    def project(self, part: Part, X: torch.Tensor, D: torch.Tensor, mask: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """(N, k_out k_in): P_out^T G_i P_in for each sample of a padded batch, at dtype."""
        p_in, p_out = self.matrices(part, X.device, dtype)
        Z, Y = masked(X, mask, dtype) @ p_in, masked(D, mask, dtype) @ p_out  # (N, T, k_in), (N, T, k_out)
        return (Y.transpose(1, 2) @ Z).flatten(1)


class ProjectionCapture(KeptCapture):
    """A batch's projected gradients: kept[part] = ((N, k_out k_in),) at dtype (zero where a sample did
    not reach a routed part: its gradient there is zero)."""

    def __init__(self, targets: list[Target], batch: BatchLayout, projection: KroneckerProjection,
                 dtype: torch.dtype) -> None:
        super().__init__(targets, batch)
        self.projection, self.dtype = projection, dtype

    def on_part(self, part: Part, captured: Captured) -> None:
        projected = self.projection.project(part, captured.X, captured.D, captured.mask, self.dtype)
        self.kept[part.name] = (captured.scatter(projected),)

    def vectors(self) -> torch.Tensor:
        """(N, dims) fp32 on the host, parts in the projection's order; NaN where nothing was
        captured (no sample of the batch had a loss to differentiate)."""
        N = self.batch.N
        if not self.kept:
            return torch.full((N, self.projection.dims), torch.nan)
        zero = torch.zeros(N, self.projection.k_in * self.projection.k_out)
        return torch.cat([self.kept[p.name][0].float().cpu() if p.name in self.kept else zero
                          for p in self.projection.parts], 1)

    def finish(self, scores) -> None:
        finite = scores.scored
        scores.projection = torch.where(finite[:, None], self.vectors(), torch.nan)
        for i in torch.nonzero(finite & ~torch.isfinite(scores.projection).all(1)).flatten().tolist():
            scores.flags[i].add("nonfinite_gradient")


def leading_block(values: torch.Tensor, parts: int, k: int, smaller: int) -> torch.Tensor:
    """(n, parts k k) projections at k -> the same samples' projections at smaller k: each part's
    leading smaller x smaller block, times k / smaller. It is the projection by the leading columns of
    P_in and P_out, whose N(0, 1/k) entries, so rescaled, are N(0, 1/smaller) as a smaller one's own."""
    blocks = values.reshape(len(values), parts, k, k)[:, :, :smaller, :smaller] * (k / smaller)
    return blocks.reshape(len(values), -1)
