import pytest
import torch
from gradspec.kernels import segment_gram_torch, segment_gram_triton, triton

from gradspec.linalg import extension, grams

needs_triton = pytest.mark.skipif(triton is None, reason="triton not installed")


@needs_triton
@pytest.mark.parametrize("shape", [(3, 37, 50), (2, 8, 16), (1, 65, 33)])
def test_triton_kernel_matches_torch(shape):
    """Runs under TRITON_INTERPRET=1 on the CPU (set in conftest)."""
    N, T, d = shape
    g = torch.Generator().manual_seed(T)
    Y = torch.randn(N, T, d, generator=g)
    lengths = torch.tensor([T, max(T // 2, 1), 1])[:N]
    other = torch.randn(N, T, T, generator=g)
    gram, inner = segment_gram_triton(Y, lengths, other)
    want, want_inner = segment_gram_torch(Y, lengths, other)
    torch.testing.assert_close(gram.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(inner.double(), want_inner, rtol=1e-5, atol=1e-3)
    for i, n in enumerate(lengths.tolist()):
        assert gram[i, n:].abs().sum() == 0 and gram[i, :, n:].abs().sum() == 0


@needs_triton
def test_inner_product_is_frobenius_norm_of_gradient():
    g = torch.Generator().manual_seed(0)
    X, D = torch.randn(2, 9, 12, generator=g), torch.randn(2, 9, 5, generator=g)
    lengths = torch.tensor([9, 4])
    B, _ = segment_gram_torch(X, lengths)
    _, inner = segment_gram_triton(D, lengths, B)
    for i, n in enumerate(lengths.tolist()):
        G = D[i, :n].double().T @ X[i, :n].double()
        assert inner[i].item() == pytest.approx(G.square().sum().item(), rel=1e-5)


BACKENDS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(not extension.BUILT, reason="no _C"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 4])
def test_cpu_paths_match_reference_in_fp64(backend, dtype, threads, monkeypatch):
    """The extension splits a sample of 64 rows or more (SPLIT_ROWS) into two tasks, a shorter one not."""
    monkeypatch.setenv("GRADSPEC_THREADS", str(threads))
    g = torch.Generator().manual_seed(1)
    Y = torch.randn(3, 70, 7, 2, generator=g).to(dtype)[..., 0]  # strided, like a fused module's part
    lengths = torch.tensor([70, 21, 0])
    other = torch.randn(3, 70, 70, generator=g, dtype=torch.float64)  # not symmetric: both triangles count
    gram, inner = grams.segment_gram(Y, lengths, other, backend)
    want, want_inner = segment_gram_torch(Y, lengths, other)
    assert gram.dtype == torch.float64
    torch.testing.assert_close(gram, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inner, want_inner, rtol=1e-12, atol=1e-12)
    assert grams.segment_gram(Y, lengths, None, backend)[1] is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_picked_rows_give_the_gathered_samples_grams_bit_for_bit(backend, dtype):
    """rows picks batch samples in place (the extension reads fp32 in place, converts the picked samples of
    other dtypes alone); a sample not picked may be longer than Y's T, sliced to the picked ones' longest."""
    g = torch.Generator().manual_seed(3)
    Y = torch.randn(4, 90, 6, generator=g).to(dtype)
    lengths, rows = torch.tensor([90, 70, 12, 40]), torch.tensor([3, 1, 2])
    T = int(lengths[rows].max())
    other = torch.randn(3, T, T, generator=g, dtype=torch.float64)
    gram, inner = grams.segment_gram(Y[:, :T], lengths, other, backend, rows)
    want, want_inner = grams.segment_gram(Y[rows][:, :T].contiguous(), lengths[rows], other, backend)
    assert torch.equal(gram, want) and torch.equal(inner, want_inner)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_a_picked_sample_longer_than_T_is_refused():
    Y, lengths = torch.randn(2, 10, 3), torch.tensor([10, 4])
    with pytest.raises(ValueError, match="lengths must lie in"):
        extension.C.segment_gram(Y[:, :4].numpy(), lengths.numpy(), None, 1, torch.tensor([0]).numpy())
    with pytest.raises(ValueError, match="rows must lie in"):
        extension.C.segment_gram(Y.numpy(), lengths.numpy(), None, 1, torch.tensor([2]).numpy())


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
@pytest.mark.parametrize("threads", [1, 4])
def test_extension_writes_every_entry(threads):
    """The extension's output is not zero-filled up front: each sample's task writes its padding and
    mirrors its triangle. Memory freed full of NaN and handed out again must not show through."""
    import numpy as np

    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        lengths = torch.randint(0, 30, (3,), generator=g)
        T = int(lengths.max()) + trial % 3
        Y = torch.randn(3, T, 5, generator=g)
        np.full((3, T, T), np.nan)  # freed at once: the next block of this size likely reuses it
        gram, _ = extension.C.segment_gram(Y.numpy(), lengths.numpy(), None, threads)
        want, _ = segment_gram_torch(Y, lengths)
        np.testing.assert_allclose(gram, want.numpy(), rtol=1e-12, atol=1e-12)
