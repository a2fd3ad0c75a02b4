import pytest
import torch

from gradspec.linalg import eigen, extension, solvers
from gradspec.linalg.metrics import metrics_from_singular_values

BACKENDS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(not extension.BUILT, reason="no _C"))]


LENGTHS = torch.tensor([24, 1, 7, 21, 12, 2])


def _problem(N=6, M=3, T=24, d_in=40, d_out=30, seed=0):
    """Per-sample X, D with padding (LENGTHS) and a rank-deficient sample (repeated rows)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, T, d_in, generator=g, dtype=torch.float64)
    D = torch.randn(N, M, T, d_out, generator=g, dtype=torch.float64)
    for i, n in enumerate(LENGTHS[:N]):
        X[i, n:] = 0
        D[i, :, n:] = 0
    X[0, 5:10] = X[0, 4]  # repeated inputs, as for repeated tokens at layer 0
    return X, D


def _svd(X, D):
    G = D.transpose(-1, -2) @ X.unsqueeze(1)  # (N, M, d_out, d_in)
    return torch.linalg.svdvals(G)


@pytest.mark.parametrize("backend", BACKENDS)
def test_core_spectra_equal_svd(backend):
    X, D = _problem()
    sigma, metrics = eigen.core_spectra(X @ X.transpose(-1, -2), D @ D.transpose(-1, -2), LENGTHS, backend)
    want = _svd(X, D)
    k = min(sigma.shape[-1], want.shape[-1])
    torch.testing.assert_close(sigma[..., :k], want[..., :k], rtol=1e-7, atol=1e-6)
    torch.testing.assert_close(metrics, metrics_from_singular_values(want), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gram_spectra_equal_svd(backend):
    X, D = _problem()
    G = (D.transpose(-1, -2) @ X.unsqueeze(1)).flatten(0, 1)
    sigma, metrics = eigen.gram_spectra(G @ G.transpose(-1, -2), backend)
    want = torch.linalg.svdvals(G)
    torch.testing.assert_close(sigma, want, rtol=1e-7, atol=1e-6)
    torch.testing.assert_close(metrics, metrics_from_singular_values(want), rtol=1e-7, atol=1e-9)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_backends_agree_and_zero_gradient_is_nan():
    X, D = _problem(seed=3)
    D[2] = 0
    B, A = X @ X.transpose(-1, -2), D @ D.transpose(-1, -2)
    s_cpp, m_cpp = eigen.core_spectra(B, A, LENGTHS, "cpp")
    s_t, m_t = eigen.core_spectra(B, A, LENGTHS, "torch")
    s_full, m_full = eigen.core_spectra(B, A, None, "cpp")  # padding computed through
    torch.testing.assert_close(m_cpp, m_full, rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(m_cpp, m_t, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert m_cpp[2, :, 0].eq(0).all() and m_cpp[2, :, 1].isnan().all()


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
@pytest.mark.parametrize("built", [True, False], ids=["pivoted on the host", "eigh without the extension"])
def test_device_cores_come_from_cholesky_and_a_rank_deficient_b_from_a_rank_revealing_factor(monkeypatch, built):
    """The device path factors B by a batched Cholesky (padding made the identity); a sample whose B
    is singular (repeated inputs, sample 0) fails it and is solved again from the extension's pivoted
    Cholesky, or B's eigendecomposition without the extension: every sample equals the SVD."""
    if built and not extension.BUILT:
        pytest.skip("no _C")
    X, D = _problem(seed=5)
    X[3, 2:6] = X[3, 1]  # a second rank-deficient sample
    B, A = X @ X.transpose(-1, -2), D @ D.transpose(-1, -2)
    redone = []
    name = "_core_cpp" if built else "_core_by_eigh"
    real = getattr(eigen, name)
    monkeypatch.setattr(extension, "BUILT", built)
    monkeypatch.setattr(eigen, name, lambda *a, **k: redone.append(len(a[-1])) or real(*a, **k))
    sigma = eigen._core_device(solvers.TORCH_EIGEN, B, A, LENGTHS)
    assert redone == [2]  # samples 0 and 3, together; the others from their Cholesky factor
    k = min(A.shape[-1], 30)
    torch.testing.assert_close(sigma[..., :k], _svd(X, D)[..., :k], rtol=1e-7, atol=1e-6)


def test_a_failed_device_factor_holding_nan_does_not_fail_the_other_samples(monkeypatch):
    """A GPU's batched potrf can leave NaN in a factor it could not finish (the CPU's leaves B's finite
    entries), and cuSOLVER's eigensolver fails the whole batch on them: the device path must keep such
    factors out of the batch's cores, then redo those samples from a rank-revealing factor."""
    X, D = _problem(seed=5)  # sample 0's B is singular
    B, A = X @ X.transpose(-1, -2), D @ D.transpose(-1, -2)
    real_cholesky = torch.linalg.cholesky_ex

    def device_like(M):
        L, info = real_cholesky(M)
        return torch.where((info > 0)[:, None, None], torch.nan, L), info

    class Strict:  # an eigensolver that fails on non-finite input, as torch's does on CUDA
        def eigvalsh(self, M):
            if not torch.isfinite(M).all():
                raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")
            return solvers.TORCH_EIGEN.eigvalsh(M)

        def eigh(self, M):
            return solvers.TORCH_EIGEN.eigh(M)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", device_like)
    sigma = eigen._core_device(Strict(), B, A, LENGTHS)
    k = min(A.shape[-1], 30)
    torch.testing.assert_close(sigma[..., :k], _svd(X, D)[..., :k], rtol=1e-7, atol=1e-6)


def test_extension_rejects_bad_shapes():
    with pytest.raises(ValueError, match="shape"):
        eigen.gram_spectra(torch.zeros(2, 3, 4), "cpp")
    with pytest.raises(ValueError, match="shape"):
        eigen.core_spectra(torch.zeros(2, 3, 3), torch.zeros(2, 1, 4, 4), None, "cpp")
    with pytest.raises(ValueError, match="lengths"):
        eigen.core_spectra(torch.zeros(2, 3, 3), torch.zeros(2, 1, 3, 3), torch.tensor([1, 4]), "cpp")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        eigen.gram_spectra(torch.zeros(1, 2, 2), "magic")


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_scipy_lapack_alone_gives_the_same_spectra():
    """Where torch exports no MKL, the extension runs on SciPy's OpenBLAS alone."""
    X, D = _problem(seed=5)
    B, A = X @ X.transpose(-1, -2), D @ D.transpose(-1, -2)
    G = (D.transpose(-1, -2) @ X.unsqueeze(1)).flatten(0, 1)
    default = eigen.core_spectra(B, A, LENGTHS, "cpp"), eigen.gram_spectra(G @ G.transpose(-1, -2), "cpp")
    try:
        extension.C.bind_lapack(**extension.lapack_addresses(prefer_mkl=False))
        scipy_only = eigen.core_spectra(B, A, LENGTHS, "cpp"), eigen.gram_spectra(G @ G.transpose(-1, -2), "cpp")
    finally:
        extension.C.bind_lapack(**extension.lapack_addresses())
    for (_, m_default), (_, m_scipy) in zip(default, scipy_only, strict=True):
        torch.testing.assert_close(m_scipy, m_default, rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
@pytest.mark.parametrize("n_wins", [True, False])
def test_python_and_cpp_share_one_cut_off_rule(n_wins):
    """max(n, terms) * eps * max: the C++ extension (cutoff_of) and the device paths
    (metrics.eigenvalue_cutoff) zero exactly the same eigenvalues, just either side of it."""
    n, eps = 6, 1e-6
    terms = 2 if n_wins else 1000
    cutoff = max(n, terms) * eps  # the largest eigenvalue is 1
    lam = torch.tensor([1.0, 0.5, cutoff * 1.01, cutoff * 0.99, cutoff * 0.5, 0.0], dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    grams = (q * lam) @ q.T
    host = eigen._gram_cpp(grams[None], eps, terms)
    device = eigen._gram_device(solvers.TORCH_EIGEN, grams[None], eps, terms)
    want = [1.0, 0.5 ** 0.5, (cutoff * 1.01) ** 0.5, 0.0, 0.0, 0.0]
    torch.testing.assert_close(host[0], torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(device[0], host[0], rtol=1e-6, atol=0)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_groups_solved_in_one_job_equal_each_group_alone():
    """host_core_spectra: groups of different sample counts, lengths and part counts in one job of the
    extension give each group's core_spectra exactly (the same routine per sample)."""
    groups = []
    for seed, (N, M, T) in enumerate([(1, 3, 24), (4, 1, 16), (2, 2, 24)]):
        X, D = _problem(N=N, M=M, T=T, seed=seed)
        lengths = LENGTHS[:N].clamp(max=T)
        groups.append((X @ X.transpose(-1, -2), list((D @ D.transpose(-1, -2)).unbind(1)), lengths, 40 + seed))
    joint = eigen.host_core_spectra(groups, "cpp")
    for (B, A, lengths, terms), (sigma, metrics) in zip(groups, joint, strict=True):
        want_sigma, want_metrics = eigen.core_spectra(B, torch.stack(A, 1), lengths, "cpp", terms=terms)
        assert torch.equal(sigma, want_sigma)
        assert torch.equal(metrics.isnan(), want_metrics.isnan())
        torch.testing.assert_close(metrics, want_metrics, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_spectra_do_not_depend_on_the_callers_thread_settings():
    """MKL's thread count changes its rounding. Whatever torch.set_num_threads last set (it sets
    MKL's global count, as a training script may), a sample solved alone (an OpenMP region of one
    thread, not nested) and in a batch's region runs MKL on one thread: the same bits."""
    X, D = _problem(N=2, M=2, T=24, seed=2)
    B, A = X @ X.transpose(-1, -2), D @ D.transpose(-1, -2)
    old = torch.get_num_threads()
    solved = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            solved.append(eigen.core_spectra(B, A, LENGTHS[:2], "cpp")[0])
            solved.extend(eigen.core_spectra(B[i:i + 1], A[i:i + 1], LENGTHS[i:i + 1], "cpp")[0][0] for i in range(2))
    finally:
        torch.set_num_threads(old)
    want = solved[0]
    for batch, first, second in zip(solved[0::3], solved[1::3], solved[2::3], strict=True):
        assert torch.equal(batch, want) and torch.equal(first, want[0]) and torch.equal(second, want[1])


@pytest.mark.skipif(not extension.BUILT or "mkl_set_num_threads_local" not in extension.lapack_addresses(),
                    reason="no _C, or no MKL in torch")
def test_the_callers_own_mkl_thread_setting_is_put_back():
    """The extension sets MKL to one thread on the threads it runs (the caller's among them) and puts
    back what each had: a training script's per-thread MKL setting survives a scoring call."""
    import ctypes

    set_local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(extension.lapack_addresses()["mkl_set_num_threads_local"])
    X, D = _problem(N=1, M=1, T=24)
    previous = set_local(3)
    try:
        eigen.core_spectra(X @ X.transpose(-1, -2), D @ D.transpose(-1, -2), LENGTHS[:1], "cpp")
        assert set_local(3) == 3
    finally:
        set_local(previous)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_materialised_parts_solved_in_one_job_equal_each_alone():
    g = torch.Generator().manual_seed(3)
    groups = []
    for N, n, d, terms in [(1, 12, 30, 30), (3, 7, 9, 40), (2, 12, 4, 12)]:  # the last of rank 4
        G = torch.randn(N, n, d, generator=g, dtype=torch.float64)
        groups.append((G @ G.transpose(1, 2), terms))
    joint = eigen.host_gram_spectra(groups, "cpp")
    for (grams, terms), (sigma, metrics) in zip(groups, joint, strict=True):
        want_sigma, want_metrics = eigen.gram_spectra(grams, "cpp", terms=terms)
        assert torch.equal(sigma, want_sigma)
        torch.testing.assert_close(metrics, want_metrics, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_a_batch_solves_its_inputs_cores_in_one_job(monkeypatch):
    """The engine hands every input's core group of a batch to the extension at once, whatever the
    batch size: a batch of one long sample keeps every thread busy."""
    from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model

    from gradspec.engine import capture
    from gradspec.engine.spectral_engine import SpectralEngine

    calls = []
    real = capture.host_core_spectra
    monkeypatch.setattr(capture, "host_core_spectra", lambda groups, *a: calls.append(len(groups)) or real(groups, *a))
    model = tiny_model("llama", vocab=500)
    seqs = random_sequences([13], 500)
    scores = SpectralEngine(model, "attn").score(*padded_batch(seqs))
    assert calls == [2 * model.config.num_hidden_layers]  # q/k/v's input and o's, per layer, in one call
    assert_matches_reference(model, scores, seqs, "attn")


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_a_batch_solves_its_materialised_parts_in_one_job(monkeypatch):
    """Samples longer than a part's smaller side take the Gram of G; a batch's such parts go to the
    extension at once."""
    from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model

    from gradspec.engine import capture
    from gradspec.engine.spectral_engine import SpectralEngine

    calls = []
    real = capture.host_gram_spectra
    monkeypatch.setattr(capture, "host_gram_spectra", lambda groups, *a: calls.append(len(groups)) or real(groups, *a))
    model = tiny_model("llama", vocab=500)
    seqs = random_sequences([70], 500)  # longer than every attention module's smaller side here
    scores = SpectralEngine(model, "attn").score(*padded_batch(seqs))
    assert calls == [4 * model.config.num_hidden_layers]
    assert_matches_reference(model, scores, seqs, "attn")
