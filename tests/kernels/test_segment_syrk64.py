"""The fp64 segment SYRK kernel against its torch reference, under TRITON_INTERPRET=1 on the CPU."""

import logging

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
@pytest.mark.parametrize("error", ["front end", "lowering"])
def test_a_compiler_without_fp64_dot_falls_back_to_the_fma_loop(monkeypatch, caplog, error):
    """Whether the compiler refuses fp64 dot in its front end (CompilationError) or in a backend pass
    (another exception), the kernel is compiled again without it."""
    from gradspec.kernels import segment_syrk64 as module

    real, seen = module.launch, []

    def launch(kernel, grid, *args, **meta):
        seen.append(meta["DOT"])
        if meta["DOT"] and error == "front end":
            raise triton.CompilationError("k.py", None, "fp64 dot unsupported on this GPU")
        if meta["DOT"]:
            raise RuntimeError("PassManager::run failed")
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", launch)
    monkeypatch.setattr(module, "FMA_FALLBACK", {})
    Y, lengths = torch.randn(2, 10, 12, dtype=torch.float64), torch.tensor([10, 6])
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        gram, inner = segment_syrk64_triton(Y, lengths)
        again, _ = segment_syrk64_triton(Y, lengths)
    # a failed compilation is not cached by Triton: the device is remembered, not retried every call
    assert seen == [True, False, False] and inner is None and list(module.FMA_FALLBACK) == ["cpu"]
    assert sum("FMA units" in r.getMessage() for r in caplog.records) == 1
    for got in (gram, again):
        torch.testing.assert_close(got, segment_syrk64_torch(Y, lengths)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 35])
def test_lower_tiles_are_the_lower_triangles_pairs_row_major_made_on_the_device(n, monkeypatch):
    """No host list is copied to the device for them (that copy would wait for the stream on every call)."""
    from gradspec.kernels.segment_syrk64 import lower_tiles

    def no_host_tensor(*args, **kwargs):
        raise AssertionError("a host tensor was made")

    want = torch.tensor([(i, j) for i in range(n) for j in range(i + 1)], dtype=torch.int32).reshape(-1, 2)
    monkeypatch.setattr(torch, "tensor", no_host_tensor)
    tiles = lower_tiles(n, "cpu")
    assert tiles.dtype == torch.int32 and torch.equal(tiles, want)


@needs_triton
def test_an_error_the_fma_loop_shares_is_raised_and_does_not_demote_the_device(monkeypatch):
    from gradspec.kernels import segment_syrk64 as module

    def launch(kernel, grid, *args, **meta):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(module, "launch", launch)
    monkeypatch.setattr(module, "FMA_FALLBACK", {})
    with pytest.raises(RuntimeError, match="out of resources"):
        segment_syrk64_triton(torch.randn(2, 10, 12), torch.tensor([10, 6]))
    assert module.FMA_FALLBACK == {}
