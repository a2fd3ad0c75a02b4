"""Per-sample segment Gram Y_i Y_i^T in fp64, the exact policy's Gram on a GPU, with the fused
Frobenius inner product <Y_i Y_i^T, other_i> (for Y = D and other = X X^T: ||G||_F^2).

Y is read in its own dtype (bf16, fp16, fp32 or fp64) and cast to fp64 in registers: no fp64 copy
of X or D is made. Only the lower triangle's tiles are computed (a SYRK: half a GEMM's products),
each stored with its mirror, so the output is the full symmetric Gram; tiles past a sample's length
are neither computed nor stored (the output starts as zeros), so padding costs nothing.
``segment_syrk64_torch`` is the reference it is tested against (the fp64 torch Gram).
"""

from __future__ import annotations

import logging

import torch

from .blocks import blocks
from .launch import launch
from .segment_gram import segment_gram_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the torch path serves without it
    triton = None

log = logging.getLogger("gradspec")
# Devices whose compiler failed the fp64 dot -> its error: they take the FMA loop from then on (a failed
# compilation is not cached, so retrying it would cost every call), and the GPU acceptance reports it.
FMA_FALLBACK: dict[str, str] = {}


def segment_syrk64_torch(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Y (N, T, d), lengths (N,) -> fp64 Gram (N, T, T), zero beyond each length; inner (N,) or None."""
    return segment_gram_torch(Y, lengths, other, torch.float64)


if triton is not None:

    @triton.jit
    def _segment_syrk64_kernel(
        y_ptr, len_ptr, tiles_ptr, gram_ptr, other_ptr, partial_ptr,
        T, d, n_lower,
        stride_yn, stride_yt, stride_yd,
        HAS_OTHER: tl.constexpr, DOT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One axis of (sample, tile) pairs: axes 1 and 2 take at most 65,535 programs, which a long sample's
        # tiles (T > 11,552) or a batch of many short samples would pass.
        pid = tl.program_id(0).to(tl.int64)  # sample offsets pass 2**31 in large batches
        n = pid // n_lower
        tile = pid % n_lower
        ti = tl.load(tiles_ptr + 2 * tile)  # a lower tile: ti >= tj
        tj = tl.load(tiles_ptr + 2 * tile + 1)
        length = tl.load(len_ptr + n)
        if ti * BLOCK_T < length:  # a tile whose rows are all padding is left zero (ti >= tj)
            rows = (ti * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # row offsets pass 2**31 too
            cols = (tj * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
            acc = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float64)
            base = y_ptr + n * stride_yn
            for k0 in range(0, d, BLOCK_D):
                ks = k0 + tl.arange(0, BLOCK_D)
                a = tl.load(base + rows[:, None] * stride_yt + ks[None, :] * stride_yd,
                            mask=(rows[:, None] < length) & (ks[None, :] < d), other=0.0).to(tl.float64)
                b = tl.load(base + cols[:, None] * stride_yt + ks[None, :] * stride_yd,
                            mask=(cols[:, None] < length) & (ks[None, :] < d), other=0.0).to(tl.float64)
                if DOT:
                    acc += tl.dot(a, tl.trans(b))
                else:  # where the GPU's compiler has no fp64 dot: products and sums on the FMA units
                    acc += tl.sum(a[:, None, :] * b[None, :, :], axis=2)
            inside = (rows[:, None] < T) & (cols[None, :] < T)
            out = n * T * T + rows[:, None] * T + cols[None, :]
            tl.store(gram_ptr + out, acc, mask=inside)
            if ti != tj:  # the mirror tile, above the diagonal
                tl.store(gram_ptr + n * T * T + cols[None, :] * T + rows[:, None], acc, mask=inside)
            if HAS_OTHER:  # the tile's and its mirror's share of <Gram, other>
                o = tl.load(other_ptr + out, mask=inside, other=0.0).to(tl.float64)
                if ti != tj:
                    o += tl.load(other_ptr + n * T * T + cols[None, :] * T + rows[:, None], mask=inside, other=0.0)
                tl.store(partial_ptr + n * n_lower + tile, tl.sum(acc * o))


def lower_tiles(n_tiles: int, device: torch.device | str) -> torch.Tensor:
    """(n_lower, 2) int32: the (row, column) tile pairs of the lower triangle, row-major. Made on the
    device (a host list copied there would wait for the stream: every call, in the backward's hooks)."""
    return torch.tril_indices(n_tiles, n_tiles, device=device).T.to(torch.int32).contiguous()


def segment_syrk64_triton(
    Y: torch.Tensor, lengths: torch.Tensor, other: torch.Tensor | None = None,
    block_t: int | None = None, block_d: int | None = None, dot: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``segment_syrk64_torch``; runs on CUDA or under TRITON_INTERPRET=1. dot=False
    sums the products without tl.dot (a compiler without fp64 dot); a failing fp64 dot falls back to it.
    Blocks left None are the device's (kernels.blocks)."""
    if triton is None:
        raise RuntimeError("segment_syrk64_triton needs triton (pip install 'gradspec[triton]')")
    block_t, block_d = blocks("segment_syrk64", Y.device, block_t=block_t, block_d=block_d).values()
    N, T, d = Y.shape
    tiles = lower_tiles(triton.cdiv(T, block_t), Y.device)
    gram = torch.zeros((N, T, T), device=Y.device, dtype=torch.float64)
    partial = torch.zeros((N, max(len(tiles), 1)), device=Y.device, dtype=torch.float64)
    other64 = None if other is None else other.to(torch.float64).contiguous()
    args = (Y, lengths.to(device=Y.device, dtype=torch.int32).contiguous(), tiles, gram,
            other64 if other64 is not None else gram, partial, T, d, len(tiles), Y.stride(0), Y.stride(1), Y.stride(2))
    if len(tiles) and N:
        dot = dot and str(Y.device) not in FMA_FALLBACK
        grid, meta = (N * len(tiles),), dict(HAS_OTHER=other is not None, BLOCK_T=block_t)
        try:
            launch(_segment_syrk64_kernel, grid, *args, DOT=dot, BLOCK_D=block_d if dot else min(block_d, 8), **meta)
        except Exception as error:  # noqa: BLE001 - a compiler without fp64 dot fails in the front end or in lowering
            if not dot:
                raise
            launch(_segment_syrk64_kernel, grid, *args, DOT=False, BLOCK_D=min(block_d, 8), **meta)
            # only once the FMA loop has run: an error it shares is not the fp64 dot's
            FMA_FALLBACK[str(Y.device)] = f"{type(error).__name__}: {str(error)[:300]}"
            log.warning("the fp64 segment SYRK's tl.dot failed on %s (%s); it sums on the FMA units from now on",
                        Y.device, FMA_FALLBACK[str(Y.device)])
    return gram, (None if other is None else partial.sum(1))
