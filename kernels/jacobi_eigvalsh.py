"""Eigenvalues of a batch of small symmetric matrices by parallel cyclic Jacobi, one matrix per
program, for the GPU, where ``torch.linalg.eigvalsh`` solves one matrix at a time for n > 32.

Each sweep runs n - 1 rounds of the round-robin ("chess tournament") pairing: in a round the
n/2 index pairs are disjoint, so all their rotations apply at once, A <- J^T A J, as two matrix
products. Padding up to a power of two (at least 16, for ``tl.dot``) puts a sentinel far below
every eigenvalue on the diagonal; the padded rows never couple to the others and are dropped.

``jacobi_eigvalsh_triton`` is the kernel; ``torch.linalg.eigvalsh`` is the reference it is
tested against (the eigenvalues, ascending, as eigvalsh returns them).
"""

from __future__ import annotations

import torch

from .launch import launch
from .segment_gram import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _partner(i, r, n):
        """Round r of the circle method: player 0 stays, the others rotate; i meets partner(i)."""
        pos = tl.where(i == 0, 0, (i - 1 - r + 2 * (n - 1)) % (n - 1) + 1)
        other = n - 1 - pos
        return tl.where(other == 0, 0, (other - 1 + r) % (n - 1) + 1)

    @triton.jit
    def _jacobi_kernel(a_ptr, out_ptr, sweeps, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # b * BLOCK * BLOCK passes 2**31 at 131,072 matrices of 128
        rows = tl.arange(0, BLOCK)
        A = tl.load(a_ptr + b * BLOCK * BLOCK + rows[:, None] * BLOCK + rows[None, :])
        eye = rows[:, None] == rows[None, :]
        for _ in range(sweeps):
            for r in range(BLOCK - 1):
                partner = _partner(rows, r, BLOCK)
                couple = rows[None, :] == partner[:, None]  # (i, partner(i))
                diag = tl.sum(tl.where(eye, A, 0.0), axis=1)
                a_ij = tl.sum(tl.where(couple, A, 0.0), axis=1)
                d_partner = tl.sum(tl.where(couple, diag[None, :], 0.0), axis=1)
                # Pair (p, q), p < q: tau = (a_qq - a_pp) / (2 a_pq); the same rotation seen from both ends
                first = rows < partner
                a_pp = tl.where(first, diag, d_partner)
                a_qq = tl.where(first, d_partner, diag)
                safe = tl.where(a_ij == 0.0, 1.0, a_ij)
                tau = (a_qq - a_pp) / (2.0 * safe)
                tame = tl.minimum(tl.abs(tau), 1e18)  # tau^2 must not overflow fp32; t < 1e-18 beyond anyway
                t = tl.where(tau >= 0, 1.0, -1.0) / (tl.abs(tau) + tl.sqrt(1.0 + tame * tame))
                t = tl.where(a_ij == 0.0, 0.0, t)
                c = 1.0 / tl.sqrt(1.0 + t * t)
                s = tl.where(first, t * c, -t * c)  # J[p, q] = s, J[q, p] = -s
                J = tl.where(eye, c[:, None], 0.0) + tl.where(couple, s[:, None], 0.0)
                A = tl.dot(tl.trans(J), tl.dot(A, J, input_precision="ieee"), input_precision="ieee")
        tl.store(out_ptr + b * BLOCK + rows, tl.sum(tl.where(eye, A, 0.0), axis=1))


def jacobi_eigvalsh_triton(A: torch.Tensor, sweeps: int = 10) -> torch.Tensor:
    """(B, n, n) symmetric -> (B, n) eigenvalues, ascending; in A's dtype (fp32 or fp64)."""
    if triton is None:
        raise RuntimeError("jacobi_eigvalsh_triton needs triton (pip install 'gradspec[triton]')")
    B, n, _ = A.shape
    block = max(16, triton.next_power_of_2(n))
    sentinel = -2.0 * (A.flatten(1).norm(dim=1).max() + 1.0)  # below every eigenvalue: |lambda| <= ||A||_F
    padded = torch.zeros((B, block, block), device=A.device, dtype=A.dtype)
    padded[:, :n, :n] = A
    padded.diagonal(dim1=1, dim2=2)[:, n:] = sentinel
    out = torch.empty((B, block), device=A.device, dtype=A.dtype)
    # a whole matrix and two products of it live in one program: more warps, fewer registers each, at 64 and up
    launch(_jacobi_kernel, (B,), padded, out, sweeps, BLOCK=block, num_warps=8 if block >= 64 else 4)
    return out.sort(dim=1).values[:, block - n:]
