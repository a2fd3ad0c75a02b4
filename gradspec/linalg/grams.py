"""Per-sample Grams over each sample's valid tokens, the engine's first linear-algebra stage.

``segment_gram``: Y_i Y_i^T (X X^T and D D^T): the extension's dsyrk (host, fp64), torch (at the
policy's precision) or a Triton kernel (fp32: segment_gram; fp64: the segment SYRK, which reads Y
in its own dtype).
``segment_tdot``: the low-rank sketch's A_i^T B_i: torch, or the Triton kernel (fp32 only).
"""

from __future__ import annotations

from functools import partial

import torch

from gradspec import kernels
from gradspec.linalg import extension, stages
from gradspec.linalg.dispatch import size_bucket
from gradspec.linalg.policy import Policy


def segment_gram(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None, policy: Policy | str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sample Gram Y_i Y_i^T over valid tokens (N, T, T) in the policy's precision, and
    <Gram_i, other_i> when other is given. lengths lie on Y's device (the host copy for the
    extension is then free, or the caller's own once per batch)."""
    policy = Policy.of(policy)
    calls = {
        "cpp": partial(_segment_gram_cpp, Y, lengths, other),
        "torch": partial(kernels.segment_gram_torch, Y, lengths, other, policy.dtype),
        "triton": partial(kernels.segment_syrk64_triton if policy.precision == "fp64" else kernels.segment_gram_triton,
                          Y, lengths, other),
    }
    return stages.run("segment_gram", Y, policy, (size_bucket(Y.shape[1]), Y.shape[2], other is not None), calls)


def _segment_gram_cpp(Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None):
    Y = Y.detach() if Y.dtype in (torch.float32, torch.float64) else Y.detach().float()
    with extension.ONE_BLAS_THREAD():
        gram, inner = extension.C.segment_gram(Y.numpy(), lengths.cpu().to(torch.int64).numpy(),
                                               None if other is None else extension.as_numpy(other),
                                               extension.default_threads())
    return torch.from_numpy(gram), None if inner is None else torch.from_numpy(inner)


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
