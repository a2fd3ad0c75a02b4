"""Per-sample Grams over each sample's valid tokens, the engine's first linear-algebra stage.

``segment_gram``: Y_i Y_i^T (X X^T and D D^T): the extension's dsyrk (host, fp64), torch (at the
policy's precision) or a Triton kernel (fp32: segment_gram; fp64: the segment SYRK, which reads Y
in its own dtype).
``product_gram``: the Gram of G_i = D_i^T X_i (the materialised path, samples at least as long as
G's smaller side): the extension's dgemm and dsyrk over valid rows (host, fp64), or torch.
``segment_tdot``: the low-rank sketch's A_i^T B_i: torch, or the Triton kernel (fp32 only).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from gradspec import kernels
from gradspec.linalg import extension, stages
from gradspec.linalg.dispatch import size_bucket
from gradspec.linalg.host_copies import to_device
from gradspec.linalg.policy import Policy

# The Triton kernel of segment_gram's triton path, per precision: fp64's reads Y in its own dtype.
TRITON_GRAM: dict[str, Callable] = {"fp64": kernels.segment_syrk64_triton, "fp32": kernels.segment_gram_triton}


def segment_gram(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None, policy: Policy | str = "auto",
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sample Gram Y_i Y_i^T over valid tokens (K, T, T) in the policy's precision, and
    <Gram_k, other_k> when other (K, T, T) is given, for the batch samples rows (K,) on the host (None:
    all of them; the extension reads them in place, the other paths gather them). lengths (N,) lie on
    Y's device (the host copy for the extension is then free, or the caller's own once per batch)."""
    policy = Policy.of(policy)
    calls = {
        "cpp": partial(_segment_gram_cpp, Y, lengths, other, rows),
        "torch": partial(_gathered(kernels.segment_gram_torch), Y, lengths, other, rows, policy.dtype),
        "triton": partial(_gathered(TRITON_GRAM[policy.precision]), Y, lengths, other, rows),
    }
    return stages.run("segment_gram", Y, policy, (size_bucket(Y.shape[1]), Y.shape[2], other is not None), calls)


def _rows(rows: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """These per-sample tensors' entries of the batch samples rows (host indices; None: the tensors as they are)."""
    if rows is None:
        return tensors
    index = to_device(rows, tensors[0].device)
    return tuple(t[index] for t in tensors)


def _gathered(kernel: Callable) -> Callable:
    """kernel(Y, lengths, other, *args) over the samples rows of Y and lengths (None: all of them)."""
    def call(Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None, rows: torch.Tensor | None, *args):
        return kernel(*_rows(rows, Y, lengths), other, *args)
    return call


def _segment_gram_cpp(Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None, rows: torch.Tensor | None):
    Y, lengths = Y.detach(), lengths.cpu()
    if Y.dtype not in (torch.float32, torch.float64):  # the extension reads fp32/fp64: the picked samples converted
        (Y, lengths), rows = _rows(rows, Y, lengths), None
        Y = Y.float()
    with extension.ONE_BLAS_THREAD():
        gram, inner = extension.C.segment_gram(Y.numpy(), lengths.to(torch.int64).numpy(),
                                               None if other is None else extension.as_numpy(other),
                                               extension.default_threads(),
                                               None if rows is None else rows.to(torch.int64).numpy())
    return torch.from_numpy(gram), None if inner is None else torch.from_numpy(inner)


def product_gram(
    D: torch.Tensor, X: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None, T: int,
    policy: Policy | str = "auto", x_gram: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-sample Gram of G_i = D_i^T X_i over valid tokens, G G^T where D is the narrower (else G^T G),
    (K, m, m) with m = min(p, q), in the policy's precision, for the batch samples rows (K,) on the
    host (None: all of them); T is their longest length, lengths (N,) lie on D's device. x_gram gives
    those samples' X X^T (asked for only where each is shorter than q, so that the caller's one X X^T per
    input holds it): the torch path then forms D^T (X X^T) D, T x T products, about half the work of G at
    T = q / 2."""
    policy = Policy.of(policy)
    calls = {
        "cpp": partial(_product_gram_cpp, D, X, lengths, rows),
        "torch": partial(_product_gram_torch, D, X, lengths, rows, T, policy.dtype, x_gram),
    }
    return stages.run("product_gram", D, policy, (size_bucket(T), D.shape[2], X.shape[2]), calls)


def _product_gram_cpp(D: torch.Tensor, X: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None):
    D, X, lengths = D.detach(), X.detach(), lengths.cpu()
    dtype = torch.float64 if torch.float64 in (D.dtype, X.dtype) else torch.float32
    if D.dtype != dtype or X.dtype != dtype:  # converted for the extension: the picked samples alone
        (D, X, lengths), rows = _rows(rows, D, X, lengths), None
        D, X = D.to(dtype), X.to(dtype)
    with extension.ONE_BLAS_THREAD():
        gram = extension.C.product_gram(D.numpy(), X.numpy(), lengths.to(torch.int64).numpy(),
                                        None if rows is None else rows.to(torch.int64).numpy(),
                                        extension.default_threads())
    return torch.from_numpy(gram)


def _product_gram_torch(D: torch.Tensor, X: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None, T: int,
                        dtype: torch.dtype, x_gram: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    D, X, lengths = _rows(rows, D, X, lengths)
    p, q = D.shape[2], X.shape[2]
    Ds = D[:, :T].to(dtype)
    if p <= q and T < q and x_gram is not None:
        B = x_gram().to(dtype)  # zero beyond each sample's length
        return Ds.transpose(1, 2) @ (B @ Ds)
    valid = torch.arange(T, device=X.device)[None, :] < lengths[:, None]  # lengths on X's device: no wait
    Xs = X[:, :T].to(dtype) * valid[..., None]
    G = Ds.transpose(1, 2) @ Xs  # (K, p, q)
    return G @ G.transpose(1, 2) if p <= q else G.transpose(1, 2) @ G


def segment_tdot(
    A: torch.Tensor, B: torch.Tensor, lengths: torch.Tensor, policy: Policy | str = "auto"
) -> torch.Tensor:
    """Per-sample A_i^T B_i over valid tokens, (N, p, q), in the policy's precision."""
    policy = Policy.of(policy)
    calls = {
        "torch": partial(kernels.segment_tdot_torch, A, B, lengths, policy.dtype),
        "triton": partial(kernels.segment_tdot_triton, A, B, lengths),
    }
    return stages.run("segment_tdot", A, policy, (size_bucket(A.shape[1]), A.shape[2], B.shape[2]), calls)
