"""Per-sample segment Gram Y_i Y_i^T over each sample's valid tokens, with a fused
Frobenius inner product <Y_i Y_i^T, other_i> (for Y = D and other = X X^T this is
||D^T X||_F^2 = ||G||_F^2, a free cross-check of the spectra).

``segment_gram_triton`` is the GPU kernel (fp32 accumulation; tiles that lie wholly in a
sample's padding only store zeros, so padding costs no products); ``segment_gram_torch``
is the reference it is tested against (fp64). gradspec.linalg.grams.segment_gram picks a path.
"""

from __future__ import annotations

import torch

from .blocks import blocks
from .launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the torch path serves without it
    triton = None


def segment_gram_torch(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Y (N, T, d), lengths (N,) -> Gram (N, T, T) in dtype (fp64: the reference), zero beyond each
    length; inner (N,) or None."""
    T = Y.shape[1]
    valid = torch.arange(T, device=Y.device)[None, :] < lengths.to(Y.device)[:, None]  # (N, T): unpadded tokens
    Yv = Y.to(dtype) * valid[..., None]
    gram = Yv @ Yv.transpose(1, 2)
    inner = None if other is None else (gram * other.to(gram)).sum((1, 2))
    return gram, inner


if triton is not None:

    @triton.jit
    def _segment_gram_kernel(
        y_ptr, len_ptr, gram_ptr, other_ptr, partial_ptr,
        T, d, n_tiles,
        stride_yn, stride_yt, stride_yd,
        HAS_OTHER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)  # sample offsets pass 2**31 in large batches
        ti = tl.program_id(1)
        tj = tl.program_id(2)
        length = tl.load(len_ptr + n)
        rows = (ti * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # row offsets may pass 2**31 too
        cols = (tj * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        acc = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        base = y_ptr + n * stride_yn
        # Tiles wholly in this sample's padding are zero: skip their products (padding-free compute)
        d_used = tl.where((ti * BLOCK_T < length) & (tj * BLOCK_T < length), d, 0)
        for k0 in range(0, d_used, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            a = tl.load(
                base + rows[:, None] * stride_yt + ks[None, :] * stride_yd,
                mask=(rows[:, None] < length) & (ks[None, :] < d), other=0.0,
            )
            b = tl.load(
                base + cols[:, None] * stride_yt + ks[None, :] * stride_yd,
                mask=(cols[:, None] < length) & (ks[None, :] < d), other=0.0,
            )
            # ieee: fp32 products, not TF32 (which would cost the Gram three decimal digits)
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        out = n * T * T + rows[:, None] * T + cols[None, :]
        inside = (rows[:, None] < T) & (cols[None, :] < T)
        tl.store(gram_ptr + out, acc, mask=inside)
        if HAS_OTHER:
            o = tl.load(other_ptr + out, mask=inside, other=0.0)
            tl.store(partial_ptr + (n * n_tiles + ti) * n_tiles + tj, tl.sum(acc * o))


def segment_gram_triton(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None,
    block_t: int | None = None, block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``segment_gram_torch``, fp32 outputs; runs on CUDA or under TRITON_INTERPRET=1.
    Blocks left None are the device's (kernels.blocks)."""
    if triton is None:
        raise RuntimeError("segment_gram_triton needs triton (pip install 'gradspec[triton]')")
    block_t, block_d = blocks("segment_gram", Y.device, block_t=block_t, block_d=block_d).values()
    N, T, d = Y.shape
    n_tiles = triton.cdiv(T, block_t)
    gram = torch.empty((N, T, T), device=Y.device, dtype=torch.float32)
    partial = torch.zeros((N, n_tiles, n_tiles), device=Y.device, dtype=torch.float32)
    other32 = None if other is None else other.to(torch.float32).contiguous()
    launch(
        _segment_gram_kernel, (N, n_tiles, n_tiles),
        Y, lengths.to(device=Y.device, dtype=torch.int32).contiguous(), gram,
        other32 if other32 is not None else gram, partial,
        T, d, n_tiles, Y.stride(0), Y.stride(1), Y.stride(2),
        HAS_OTHER=other is not None, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    return gram, (None if other is None else partial.sum((1, 2)))
