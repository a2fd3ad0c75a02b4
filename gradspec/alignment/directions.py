"""What the pool is compared with, per scored part: K directions in gradient space, each a fixed
combination of the task examples' gradients, W_k = sum_j C_kj G_j, with G_j = D_j^T X_j.

Two routes give <G_i, W_k> exactly; which is cheaper depends on the sizes:
- "dense": W is kept as K matrices (d_out x d_in); a pool sample's G_i is formed once
  (T_i d_in d_out) and dotted with each (K d_in d_out);
- "cross": the task's own inputs and output gradients are kept (T_task rows of d_in and d_out) and
  <G_i, G_j> = <D_i D_j^T, X_i X_j^T> comes from cross-Grams (T_i T_task (d_in + d_out)), no G formed.
route_for picks the one with fewer operations per pool token: a rule on shapes, so reruns take the
same route and give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROUTES = ("dense", "cross")
TYPICAL_SAMPLE_TOKENS = 256  # spreads the dense route's per-sample dot products over tokens


def route_for(d_in: int, d_out: int, task_tokens: int, directions: int) -> str:
    """The cheaper route for a part: dense costs d_in d_out per pool token plus K d_in d_out per
    sample, cross costs task_tokens (d_in + d_out) per pool token."""
    dense = d_in * d_out * (1 + directions / TYPICAL_SAMPLE_TOKENS)
    cross = task_tokens * (d_in + d_out)
    return "cross" if cross < dense else "dense"


def held_values(route: str, d_in: int, d_out: int, task_tokens: int, directions: int) -> int:
    """How many values a part's directions hold on this route."""
    return directions * d_in * d_out if route == "dense" else task_tokens * (d_in + d_out)


def masked(Y: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Y (N, T, d) -> (N, T', d) at dtype: the first T' = mask.shape[1] (the longest sample's) rows,
    those beyond each sample's length zero (whatever they held: NaN * 0 would not be)."""
    return torch.where(mask[..., None], Y[:, : mask.shape[1]].to(dtype), 0.0)


def per_sample_gradients(X: torch.Tensor, D: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """G_i = D_i^T X_i over each sample's valid tokens: (N, d_out, d_in) at dtype."""
    return masked(D, mask, dtype).transpose(1, 2) @ masked(X, mask, dtype)


def gram_norms2(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """||d^T x||_F^2 = <x x^T, d d^T> for one sample's valid rows, without forming d^T x."""
    return ((x @ x.T) * (d @ d.T)).sum()


@dataclass
class PartDirections:
    """One part's K directions over m task examples. coefficients (K, m), on the host in fp64 and,
    as device_coefficients, where the pool's gradients are; dense: W (K, d_out, d_in); cross: the
    task's valid-token rows X (T_task, d_in), D (T_task, d_out) and owner (T_task,), the example
    each row belongs to. norms2 (m,): each example's ||G_j||^2 in this part (host, fp64);
    mean_norm2: ||mean_j G_j||^2 over the examples kept."""

    route: str
    coefficients: torch.Tensor
    norms2: torch.Tensor
    mean_norm2: float = float("nan")
    W: torch.Tensor | None = None
    X: torch.Tensor | None = None
    D: torch.Tensor | None = None
    owner: torch.Tensor | None = None
    device_coefficients: torch.Tensor | None = None
    pool_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None  # a pool-side preconditioner (dense)

    def follow(self, device: torch.device) -> None:
        """The held tensors moved to device, where the part's module runs (a dispatched model's
        modules run on several); once, at the first batch there."""
        for name in ("device_coefficients", "W", "X", "D", "owner"):
            t = getattr(self, name)
            if t is not None and t.device != device:
                setattr(self, name, t.to(device))

    def inner(self, X: torch.Tensor, D: torch.Tensor, mask: torch.Tensor, lengths: list[int],
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded batch X (N, T, d_in), D (N, T, d_out), its mask and host lengths -> <G_i, W_k>
        (N, K) and ||G_i||^2 (N,), at dtype, on X's device."""
        self.follow(X.device)
        if self.route == "dense":
            G = per_sample_gradients(X, D, mask, dtype)
            flat = (G if self.pool_gradient is None else self.pool_gradient(G)).flatten(1)
            return flat @ self.W.flatten(1).T, flat.pow(2).sum(1)
        C = self.device_coefficients
        inner, norms2 = [], []
        for i, n in enumerate(lengths):
            x, d = X[i, :n].to(dtype), D[i, :n].to(dtype)
            per_row = ((x @ self.X.T) * (d @ self.D.T)).sum(0)  # <G_i, the task row's rank-one part>
            per_example = torch.zeros(C.shape[1], dtype=dtype, device=X.device).index_add_(0, self.owner, per_row)
            inner.append(C @ per_example)
            norms2.append(gram_norms2(x, d))
        return torch.stack(inner), torch.stack(norms2)

    def unreached(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With a pool-side preconditioner, what a sample that did not reach the part (a routed one) has
        there: its gradient is zero, but Adam's update of zero is not (the momentum). (<Γ(0), W_k> (K,),
        ||Γ(0)||^2); None without one."""
        if self.pool_gradient is None:
            return None
        flat = self.pool_gradient(self.W.new_zeros(1, *self.W.shape[1:])).flatten(1)
        return (flat @ self.W.flatten(1).T)[0], flat.pow(2).sum()

    def task_inner(self) -> torch.Tensor:
        """<G_j, G_k> over the task examples (m, m), from the kept rows (cross route)."""
        m = self.coefficients.shape[1]
        rows = (self.X @ self.X.T) * (self.D @ self.D.T)
        S = torch.zeros(m, len(self.owner), dtype=rows.dtype, device=rows.device)
        S[self.owner, torch.arange(len(self.owner), device=rows.device)] = 1
        return S @ rows @ S.T
