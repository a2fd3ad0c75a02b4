"""The materialised path's Gram of G = D^T X (grams.product_gram) on every CPU path against G formed
in fp64, and the extension's rounding independent of the batch beside a sample."""

import pytest
import torch

from gradspec.linalg import extension, grams

needs_cpp = pytest.mark.skipif(not extension.BUILT, reason="no _C")
PATHS = ["torch", pytest.param("cpp", marks=needs_cpp)]


def reference(D: torch.Tensor, X: torch.Tensor, n: int) -> torch.Tensor:
    G = D[:n].double().T @ X[:n].double()
    return G @ G.T if G.shape[0] <= G.shape[1] else G.T @ G


def batch(p: int, q: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(p * q)
    D = torch.randn(4, 90, p, generator=g).to(dtype)
    X = torch.randn(4, 90, q, 2, generator=g).to(dtype)[..., 1]  # strided, like a fused module's input
    return D, X, torch.tensor([90, 70, 0, 33])  # 64 rows or more: the extension's two-task split


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("p", "q"), [(12, 40), (40, 12), (16, 16)], ids=["D narrower", "X narrower", "square"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_product_gram_is_the_gram_of_G_on_the_picked_samples(path, p, q, dtype):
    D, X, lengths = batch(p, q, dtype)
    rows = torch.tensor([3, 0, 2, 1])
    T = int(lengths[rows].max())
    gram = grams.product_gram(D, X, lengths, rows, T, grams.Policy(force={"product_gram": path}))
    assert gram.dtype == torch.float64 and gram.shape == (4, min(p, q), min(p, q))
    for k, i in enumerate(rows.tolist()):
        torch.testing.assert_close(gram[k], reference(D[i], X[i], int(lengths[i])), rtol=1e-12, atol=1e-10)


def test_the_torch_path_forms_it_from_x_x_t_where_given():
    """D^T (X X^T) D: the same Gram from T x T products."""
    D, X, lengths = batch(12, 120)
    rows = torch.tensor([1, 3])
    T = int(lengths[rows].max())
    x_gram = grams.segment_gram(X[rows][:, :T], lengths[rows], policy="torch")[0]
    asked = []
    gram = grams.product_gram(D, X, lengths, rows, T, "torch", lambda: asked.append(1) or x_gram)
    assert asked == [1]
    for k, i in enumerate(rows.tolist()):
        torch.testing.assert_close(gram[k], reference(D[i], X[i], int(lengths[i])), rtol=1e-12, atol=1e-10)


@needs_cpp
@pytest.mark.parametrize(("p", "q"), [(12, 40), (40, 12)])
def test_a_sample_s_gram_does_not_depend_on_the_batch_or_the_threads(p, q):
    """Bit for bit alone, beside others, on one thread or four: an expert's segment scores the same
    stacked with others' or alone."""
    D, X, lengths = batch(p, q)
    C = extension.C
    with extension.ONE_BLAS_THREAD():  # SciPy's BLAS inside the extension's threads: one thread each
        whole = {t: C.product_gram(D.numpy(), X.numpy(), lengths.numpy(), None, t) for t in (1, 4)}
        alone = [C.product_gram(D.numpy(), X.numpy(), lengths.numpy(), torch.tensor([i]).numpy(), 2)[0]
                 for i in range(4)]
    assert (whole[1] == whole[4]).all()
    for i in range(4):
        assert (alone[i] == whole[1][i]).all() and (alone[i] == alone[i].T).all()


@needs_cpp
def test_bad_picks_are_refused():
    D, X, lengths = batch(4, 6)
    with pytest.raises(ValueError, match="rows must lie in"):
        extension.C.product_gram(D.numpy(), X.numpy(), lengths.numpy(), torch.tensor([4]).numpy(), 1)
    with pytest.raises(ValueError, match="shapes"):
        extension.C.product_gram(D.numpy(), X[:, :5].contiguous().numpy(), lengths.numpy(), None, 1)
    with pytest.raises(ValueError, match="lengths must lie in"):  # a picked sample longer than T
        extension.C.product_gram(D[:, :40].numpy(), X[:, :40].numpy(), lengths.numpy(), torch.tensor([1]).numpy(), 1)
