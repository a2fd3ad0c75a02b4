"""Triton kernels, each next to the torch reference it is tested against."""

from .segment_gram import segment_gram_torch, segment_gram_triton, token_mask, triton

__all__ = ["segment_gram_torch", "segment_gram_triton", "token_mask", "triton"]
