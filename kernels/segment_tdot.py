"""Per-sample A_i^T B_i summed over each sample's valid tokens: (N, T, p), (N, T, q) -> (N, p, q).

The products of the low-rank sketch (gradspec.linalg.lowrank) are all of this form: G Omega =
D^T (X Omega), G^T Y = X^T (D Y), and Q^T G = (D Q)^T X. ``segment_tdot_triton`` reads A and B
in the model's dtype, stops each sample's loop at its length (padding costs nothing) and
accumulates in fp32, where the torch path needs fp64 copies of both operands;
``segment_tdot_torch`` is the reference it is tested against (fp64).
"""

from __future__ import annotations

import torch

from .blocks import blocks
from .launch import launch
from .segment_gram import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _segment_tdot_kernel(
        a_ptr, b_ptr, len_ptr, out_ptr, p, q,
        stride_an, stride_at, stride_ap, stride_bn, stride_bt, stride_bq,
        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)  # sample offsets pass 2**31 in large batches
        rows = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        length = tl.load(len_ptr + n)
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for t0 in range(0, length, BLOCK_T):
            ts = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)  # token offsets may pass 2**31 too
            a = tl.load(a_ptr + n * stride_an + ts[:, None] * stride_at + rows[None, :] * stride_ap,
                        mask=(ts[:, None] < length) & (rows[None, :] < p), other=0.0)
            b = tl.load(b_ptr + n * stride_bn + ts[:, None] * stride_bt + cols[None, :] * stride_bq,
                        mask=(ts[:, None] < length) & (cols[None, :] < q), other=0.0)
            # ieee: fp32 products, not TF32
            acc += tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), input_precision="ieee")
        tl.store(out_ptr + n * p * q + rows[:, None] * q + cols[None, :], acc,
                 mask=(rows[:, None] < p) & (cols[None, :] < q))


def segment_tdot_torch(
    A: torch.Tensor, B: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """A (N, T, p), B (N, T, q), lengths (N,) -> sum over t < length_i of A[i, t]^T B[i, t], (N, p, q) in
    dtype (fp64: the reference)."""
    valid = (torch.arange(A.shape[1], device=A.device)[None, :] < lengths.to(A.device)[:, None])[..., None]
    return (A.to(dtype) * valid).transpose(1, 2) @ B.to(dtype)


def segment_tdot_triton(
    A: torch.Tensor, B: torch.Tensor, lengths: torch.Tensor,
    block_t: int | None = None, block_p: int | None = None, block_q: int | None = None,
) -> torch.Tensor:
    """Same contract as ``segment_tdot_torch``, fp32 output; runs on CUDA or under TRITON_INTERPRET=1.
    Blocks left None are the device's (kernels.blocks)."""
    if triton is None:
        raise RuntimeError("segment_tdot_triton needs triton (pip install 'gradspec[triton]')")
    block_t, block_p, block_q = blocks("segment_tdot", A.device, block_t=block_t, block_p=block_p,
                                       block_q=block_q).values()
    N, _, p = A.shape
    q = B.shape[2]
    out = torch.empty((N, p, q), device=A.device, dtype=torch.float32)
    grid = (N, triton.cdiv(p, block_p), triton.cdiv(q, block_q))
    launch(
        _segment_tdot_kernel, grid, A, B, lengths.to(device=A.device, dtype=torch.int32).contiguous(), out, p, q,
        A.stride(0), A.stride(1), A.stride(2), B.stride(0), B.stride(1), B.stride(2),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_Q=block_q,
    )
    return out
