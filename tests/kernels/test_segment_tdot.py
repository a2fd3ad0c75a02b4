import pytest
import torch
from gradspec.kernels import segment_tdot_torch, segment_tdot_triton, triton

needs_triton = pytest.mark.skipif(triton is None, reason="triton not installed")


@needs_triton
@pytest.mark.parametrize("shape", [(3, 37, 50, 9), (2, 8, 16, 40), (1, 65, 33, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_torch(shape, dtype):
    """Runs under TRITON_INTERPRET=1 on the CPU (set in conftest); bf16 inputs as a bf16 model's."""
    N, T, p, q = shape
    g = torch.Generator().manual_seed(T)
    A = torch.randn(N, T, p, generator=g).to(dtype)
    B = torch.randn(N, T, q + 1, generator=g).to(dtype)[..., 1:]  # strided, like a fused module's part
    lengths = torch.tensor([T, max(T // 2, 1), 0])[:N]
    got = segment_tdot_triton(A, B, lengths)
    want = segment_tdot_torch(A, B, lengths)
    assert got.dtype == torch.float32 and want.dtype == torch.float64
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    for i, n in enumerate(lengths.tolist()):  # only the valid tokens count
        torch.testing.assert_close(want[i], A[i, :n].double().T @ B[i, :n].double())
