"""The fp64 segment SYRK kernel against its torch reference, under TRITON_INTERPRET=1 on the CPU."""

import pytest
import torch
from gradspec.kernels import segment_syrk64_torch, segment_syrk64_triton, triton

needs_triton = pytest.mark.skipif(triton is None, reason="triton not installed")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("dot", [True, False], ids=["tl.dot", "fma"])
@pytest.mark.parametrize("shape", [(3, 37, 50), (2, 8, 16), (1, 65, 33)])
def test_kernel_matches_the_fp64_reference_from_the_dtype_it_reads(shape, dtype, dot):
    """The Gram of Y as stored (bf16, fp16, fp32, fp64) at fp64, the upper triangle mirrored, zero past
    each length, and the fused inner product; a strided Y (a fused module's part) read in place."""
    N, T, d = shape
    g = torch.Generator().manual_seed(T)
    Y = torch.randn(N, T, 2 * d, generator=g).to(dtype)[..., ::2]  # strided features
    lengths = torch.tensor([T, max(T // 2, 1), 0])[:N]
    other = torch.randn(N, T, T, generator=g, dtype=torch.float64)
    gram, inner = segment_syrk64_triton(Y, lengths, other, block_t=16, block_d=16, dot=dot)
    want, want_inner = segment_syrk64_torch(Y, lengths, other)
    assert gram.dtype == inner.dtype == torch.float64
    torch.testing.assert_close(gram, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inner, want_inner, rtol=1e-12, atol=1e-10)
    assert torch.equal(gram, gram.transpose(1, 2))
    for i, n in enumerate(lengths.tolist()):
        assert gram[i, n:].abs().sum() == 0 and gram[i, :, n:].abs().sum() == 0


@needs_triton
def test_a_compiler_without_fp64_dot_falls_back_to_the_fma_loop(monkeypatch):
    from gradspec.kernels import segment_syrk64 as module

    real, seen = module.launch, []

    def launch(kernel, grid, *args, **meta):
        seen.append(meta["DOT"])
        if meta["DOT"]:
            raise triton.CompilationError("k.py", None, "fp64 dot unsupported on this GPU")
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", launch)
    Y, lengths = torch.randn(2, 10, 12, dtype=torch.float64), torch.tensor([10, 6])
    gram, inner = segment_syrk64_triton(Y, lengths)
    assert seen == [True, False] and inner is None
    torch.testing.assert_close(gram, segment_syrk64_torch(Y, lengths)[0], rtol=1e-12, atol=1e-12)
