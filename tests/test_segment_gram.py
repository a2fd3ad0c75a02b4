import pytest
import torch

from gradspec.kernels import segment_gram, segment_gram_torch, segment_gram_triton
from gradspec.kernels.segment_gram import triton

pytestmark = pytest.mark.skipif(triton is None, reason="triton not installed")


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


def test_inner_product_is_frobenius_norm_of_gradient():
    g = torch.Generator().manual_seed(0)
    X, D = torch.randn(2, 9, 12, generator=g), torch.randn(2, 9, 5, generator=g)
    lengths = torch.tensor([9, 4])
    B, _ = segment_gram_torch(X, lengths)
    _, inner = segment_gram_triton(D, lengths, B)
    for i, n in enumerate(lengths.tolist()):
        G = D[i, :n].double().T @ X[i, :n].double()
        assert inner[i].item() == pytest.approx(G.square().sum().item(), rel=1e-5)


def test_dispatch_uses_fp64_torch_on_cpu():
    Y = torch.randn(1, 4, 3)
    gram, inner = segment_gram(Y, torch.tensor([4]))
    assert gram.dtype == torch.float64 and inner is None
