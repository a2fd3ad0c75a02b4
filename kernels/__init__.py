"""Triton kernels, each next to the torch reference it is tested against."""

from .jacobi_eigvalsh import jacobi_eigvalsh_triton
from .segment_gram import segment_gram_torch, segment_gram_triton, token_mask, triton
from .segment_syrk64 import segment_syrk64_torch, segment_syrk64_triton
from .segment_tdot import segment_tdot_torch, segment_tdot_triton

__all__ = ["jacobi_eigvalsh_triton", "segment_gram_torch", "segment_gram_triton", "segment_syrk64_torch",
           "segment_syrk64_triton",
           "segment_tdot_torch", "segment_tdot_triton", "token_mask", "triton"]
