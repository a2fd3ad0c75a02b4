import pytest
import torch
from gradspec.kernels import jacobi_eigvalsh_triton, triton

pytestmark = pytest.mark.skipif(triton is None, reason="triton not installed")


def _symmetric(B, n, seed, psd):
    g = torch.Generator().manual_seed(seed)
    Y = torch.randn(B, n, n + 3 if psd else n, generator=g, dtype=torch.float64)
    return Y @ Y.transpose(1, 2) if psd else (Y + Y.transpose(1, 2)) / 2


@pytest.mark.parametrize(("n", "psd"), [(5, False), (16, True), (16, False), (20, True), (40, True)])
def test_jacobi_matches_eigvalsh_fp64(n, psd):
    """Sizes below and at a power of two, and one padded to 32, under TRITON_INTERPRET=1 (slow)."""
    A = _symmetric(2, n, n, psd)
    got = jacobi_eigvalsh_triton(A)
    want = torch.linalg.eigvalsh(A)
    scale = want.abs().amax(1, keepdim=True)
    assert got.shape == want.shape and ((got - want).abs() / scale).max() < 1e-10


def test_jacobi_fp32_and_rank_deficient_grams():
    Y = torch.randn(2, 14, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    A = Y @ Y.transpose(1, 2)  # rank 4 of 14: ten zero eigenvalues
    got = jacobi_eigvalsh_triton(A.float()).double()
    want = torch.linalg.eigvalsh(A)
    assert ((got - want).abs() / want.abs().amax(1, keepdim=True)).max() < 1e-5
    assert (got[:, :10].abs() < 1e-4 * want[:, -1:]).all()
