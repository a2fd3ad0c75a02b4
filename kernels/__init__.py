"""Triton kernels, each next to the torch reference it is tested against. They import nothing else of
gradspec (linalg calls them: tests/test_imports.py), so each reference masks padding itself."""

from .jacobi_eigvalsh import jacobi_eigvalsh_triton
from .segment_gram import segment_gram_torch, segment_gram_triton, triton
from .segment_syrk64 import segment_syrk64_torch, segment_syrk64_triton
from .segment_tdot import segment_tdot_torch, segment_tdot_triton

__all__ = ["jacobi_eigvalsh_triton", "segment_gram_torch", "segment_gram_triton", "segment_syrk64_torch",
           "segment_syrk64_triton",
           "segment_tdot_torch", "segment_tdot_triton", "triton"]
