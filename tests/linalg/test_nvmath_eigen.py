"""cuSOLVER's XsyevBatched through nvmath-python (solvers.syev_batched_via), on the host: a stand-in
binding checks the call protocol and solves with NumPy at the pointers it is given (CPU tensors' here,
the GPU's there), with the stream and the current device injected. What runs on a GPU is not checked here."""

import ctypes
import itertools
import sys
from contextlib import contextmanager
from types import ModuleType

import numpy as np
import pytest
import torch

from gradspec.linalg import eigen, solvers, stages
from gradspec.linalg.dispatch import MeasuredDispatch
from gradspec.linalg.policy import Policy

C = solvers.CUSOLVER_CONSTANTS
LOWER = 0  # cublasFillMode_t CUBLAS_FILL_MODE_LOWER
STREAM = 0x5EED  # what the injected stream_of gives: torch.cuda.current_stream(device).cuda_stream on a GPU


class FakeCusolverDn:
    """The part of nvmath.bindings.cusolverDn that syev_batched_via uses, over NumPy on host memory.
    It asserts the protocol: a handle made with a device current and used with that device current,
    its stream set, params from create_params, values only, one data type for A, W and the compute,
    the packed layout (lda = n), workspace sizes asked for the very problem before the call and
    buffers of at least those sizes given; it overwrites A and the workspaces, as cuSOLVER may."""

    def __init__(self, device_bytes_per_matrix: int = 24, host_bytes: int = 40) -> None:
        self.device_bytes_per_matrix, self.host_bytes = device_bytes_per_matrix, host_bytes
        self.handles: dict[int, dict] = {}
        self.params: set[int] = set()
        self.current = None  # the device device_guard made current
        self.asked: dict[tuple, tuple[int, int]] = {}
        self.calls: list[tuple] = []
        self.info: dict[int, int] = {}  # matrix index -> the info the next calls report for it
        self._ids = itertools.count(0x1000, 0x10)

    @contextmanager
    def device_guard(self, device: torch.device):
        before, self.current = self.current, device
        try:
            yield
        finally:
            self.current = before

    def create(self) -> int:
        assert self.current is not None, "a handle made with no device made current"
        handle = next(self._ids)
        self.handles[handle] = {"device": self.current, "stream": None}
        return handle

    def create_params(self) -> int:
        params = next(self._ids)
        self.params.add(params)
        return params

    def set_stream(self, handle: int, stream: int) -> None:
        assert handle in self.handles
        self.handles[handle]["stream"] = stream

    def _problem(self, handle, params, jobz, uplo, n, type_a, lda, type_w, compute, batch) -> tuple:
        assert handle in self.handles and params in self.params
        assert self.handles[handle]["stream"] == STREAM, "not on torch's current stream"
        assert self.handles[handle]["device"] == self.current, "the handle's device is not the current one"
        assert jobz == C.novector, "values only"
        assert uplo in (LOWER, C.upper)
        assert type_a == type_w == compute and type_a in (C.r32f, C.r64f)
        assert n >= 1 and lda == n and batch >= 1, (n, lda, batch)
        return handle, params, jobz, uplo, n, type_a, lda, type_w, compute, batch

    def xsyev_batched_buffer_size(self, handle, params, jobz, uplo, n, type_a, a, lda, type_w, w, compute, batch):
        problem = self._problem(handle, params, jobz, uplo, n, type_a, lda, type_w, compute, batch)
        self.asked[problem] = (self.device_bytes_per_matrix * batch, self.host_bytes)
        return self.asked[problem]

    def xsyev_batched(self, handle, params, jobz, uplo, n, type_a, a, lda, type_w, w, compute, on_device,
                      device_bytes, on_host, host_bytes, info, batch):
        problem = self._problem(handle, params, jobz, uplo, n, type_a, lda, type_w, compute, batch)
        assert problem in self.asked, "workspace sizes not asked for this problem first"
        need_device, need_host = self.asked[problem]
        assert device_bytes >= need_device and host_bytes >= need_host, (device_bytes, host_bytes)
        assert on_device and on_host and a and w and info
        ctypes.memset(on_device, 0xAB, device_bytes)  # the solver's scratch: the buffers must hold it
        ctypes.memset(on_host, 0xCD, host_bytes)
        ctype = ctypes.c_double if type_a == C.r64f else ctypes.c_float
        A = np.ctypeslib.as_array((ctype * (batch * n * lda)).from_address(a)).reshape(batch, n, lda)
        columns = A[:, :, :n].transpose(0, 2, 1)  # column-major: A_k(i, j) = a[i + lda j + lda n k]
        values = np.linalg.eigvalsh(columns, UPLO="L" if uplo == LOWER else "U")
        A[...] = np.nan  # destroyed, as jobz = NOVECTOR leaves it
        np.ctypeslib.as_array((ctype * (batch * n)).from_address(w))[:] = values.reshape(-1)
        codes = np.ctypeslib.as_array((ctypes.c_int32 * batch).from_address(info))
        codes[:] = 0
        for k, code in self.info.items():
            if k < batch:
                codes[k] = code
        self.calls.append(problem)


@pytest.fixture
def fake():
    return FakeCusolverDn()


def solver_over(binding, guard) -> solvers.Eigensolver:
    return solvers.syev_batched_via(binding, stream_of=lambda device: STREAM, device_guard=guard)


@pytest.fixture
def solver(fake):
    return solver_over(fake, fake.device_guard)


def spd(batch: tuple, n: int, rank: int | None = None, seed: int = 0) -> torch.Tensor:
    """Random positive semi-definite matrices X X^T, of rank `rank` (default full)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(*batch, n, n if rank is None else rank, generator=g, dtype=torch.float64)
    return X @ X.mT


def assert_values_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.abs().amax().clamp_min(1.0).item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("n", [1, 5, 33, 100])
@pytest.mark.parametrize("rank", ["full", "deficient"])
def test_values_are_torchs_at_every_size(solver, fake, n, rank):
    a = spd((6,), n, rank=None if rank == "full" else max(1, n // 3), seed=n)
    assert_values_close(solver.eigvalsh(a), torch.linalg.eigvalsh(a))
    assert fake.calls[-1][4:] == (n, C.r64f, n, C.r64f, C.r64f, 6)  # n, types, lda, compute, batch


def test_any_leading_batch_dimensions_and_layout(solver, fake):
    a = spd((2, 3), 7, seed=1)
    assert_values_close(solver.eigvalsh(a), torch.linalg.eigvalsh(a))
    assert fake.calls[-1][-1] == 6
    view = spd((4,), 9, seed=2).repeat(1, 2, 2)[:, ::2, ::2].mT  # strided, not contiguous
    assert_values_close(solver.eigvalsh(view), torch.linalg.eigvalsh(view))


def test_the_callers_tensor_is_left_unchanged(solver):
    a = spd((3,), 12, seed=3)
    before = a.clone()
    solver.eigvalsh(a)
    assert torch.equal(a, before)


def test_it_reads_the_triangle_torch_reads(solver):
    """Row-major data is column-major's transpose: FILL_MODE_UPPER there is UPLO="L" here."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 6, 6, generator=g, dtype=torch.float64)  # not symmetric: the triangle read matters
    assert_values_close(solver.eigvalsh(a), torch.linalg.eigvalsh(a))


def test_fp32_is_solved_in_fp32_and_other_dtypes_in_fp64(solver, fake):
    a = spd((2,), 8, seed=5)
    got = solver.eigvalsh(a.float())
    assert got.dtype == torch.float32 and fake.calls[-1][5] == C.r32f
    torch.testing.assert_close(got, torch.linalg.eigvalsh(a.float()), rtol=1e-4, atol=1e-4 * a.abs().max().item())
    assert solver.eigvalsh(a.half()).dtype == torch.float64 and fake.calls[-1][5] == C.r64f


def test_one_handle_per_device_its_stream_set_each_call(solver, fake):
    for seed in range(3):
        solver.eigvalsh(spd((2,), 4, seed=seed))
    assert len(fake.handles) == 1 and len(fake.params) == 1 and len(fake.calls) == 3
    assert all(h["device"] == torch.device("cpu") for h in fake.handles.values())


def test_an_empty_batch_needs_no_call(solver, fake):
    assert solver.eigvalsh(torch.zeros(0, 4, 4, dtype=torch.float64)).shape == (0, 4)
    assert solver.eigvalsh(torch.zeros(2, 0, 0, dtype=torch.float64)).shape == (2, 0)
    assert not fake.calls


def test_eigh_is_torchs(solver):
    assert solver.eigh is torch.linalg.eigh


def test_a_matrix_that_does_not_converge_raises_naming_its_index(solver, fake):
    fake.info = {3: 2, 4: 1}
    with pytest.raises(torch.linalg.LinAlgError, match=r"matrix 3 of the batch \(5,\) \(info = 2\); 2 of 5 failed"):
        solver.eigvalsh(spd((5,), 6))
    with pytest.raises(torch.linalg.LinAlgError, match=r"matrix \(1, 0\) of the batch \(2, 3\)"):
        solver.eigvalsh(spd((2, 3), 6))
    fake.info = {0: -4}
    with pytest.raises(ValueError, match="parameter 4 is wrong"):
        solver.eigvalsh(spd((2,), 6))


class Broken:
    """The fake binding with one argument of one function altered: the stand-in must catch it."""

    def __init__(self, fake: FakeCusolverDn, function: str, position: int, change) -> None:
        self.fake, self.function, self.position, self.change = fake, function, position, change

    def __getattr__(self, name):
        call = getattr(self.fake, name)
        if name != self.function:
            return call

        def altered(*args):
            args = list(args)
            args[self.position] = self.change(args[self.position])
            return call(*args)
        return altered


@pytest.mark.parametrize(("function", "position", "change"), [
    pytest.param("xsyev_batched", 7, lambda lda: lda + 1, id="lda"),
    pytest.param("xsyev_batched", 16, lambda batch: batch - 1, id="batch-size-of-the-call"),
    pytest.param("xsyev_batched_buffer_size", 11, lambda batch: batch - 1, id="batch-size-asked"),
    pytest.param("xsyev_batched", 12, lambda size: size - 1, id="device-workspace"),
    pytest.param("xsyev_batched", 14, lambda size: size - 1, id="host-workspace"),
    pytest.param("xsyev_batched", 2, lambda jobz: 1, id="eigenvectors"),
    pytest.param("xsyev_batched", 5, lambda kind: C.r32f, id="data-type"),
    pytest.param("set_stream", 1, lambda stream: 0, id="default-stream"),
])
def test_the_stand_in_catches_a_broken_protocol(fake, function, position, change):
    solver = solver_over(Broken(fake, function, position, change), fake.device_guard)
    with pytest.raises(AssertionError):
        solver.eigvalsh(spd((4,), 5))


def test_the_stand_in_catches_a_handle_used_on_another_device(fake):
    switch = iter([torch.device("cpu"), torch.device("meta")])

    @contextmanager
    def guard(device):
        with fake.device_guard(next(switch)):
            yield

    solver = solver_over(fake, guard)
    solver.eigvalsh(spd((2,), 3))
    with pytest.raises(AssertionError, match="device"):
        solver.eigvalsh(spd((2,), 3))


def test_both_eigen_stages_give_torchs_spectra(solver):
    g = torch.Generator().manual_seed(6)
    X, D = torch.randn(3, 9, 5, generator=g, dtype=torch.float64), torch.randn(3, 2, 9, 4, generator=g)
    B, A = X @ X.mT, (D @ D.mT).double()
    lengths = torch.tensor([9, 7, 4])
    torch.testing.assert_close(eigen._core_device(solver, B, A, lengths),
                               eigen._core_device(solvers.TORCH_EIGEN, B, A, lengths), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(eigen._gram_device(solver, A[:, 0]),
                               eigen._gram_device(solvers.TORCH_EIGEN, A[:, 0]), rtol=1e-9, atol=1e-9)


def test_nvmath_is_a_measured_and_a_forced_path_where_available(solver, fake, monkeypatch):
    monkeypatch.setattr(stages, "on_gpu", lambda t: True)
    monkeypatch.setattr(stages, "DISPATCH", MeasuredDispatch())
    monkeypatch.setattr(solvers, "nvmath_eigen", lambda: solver)
    grams = spd((4,), 6, seed=7)
    want, _ = eigen.gram_spectra(grams, Policy(force={"gram": "torch"}))
    forced = Policy(force={"gram": "nvmath"})
    got, _ = eigen.gram_spectra(grams, forced)
    assert forced.describe()["paths"] == {"gram": ["nvmath"]} and fake.calls
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    measured, _ = eigen.gram_spectra(grams, Policy())
    torch.testing.assert_close(measured, want, rtol=1e-9, atol=1e-9)
    assert "nvmath" in next(iter(stages.DISPATCH.seconds.values()))
    assert "nvmath" in stages.paths("core", grams, Policy())


@pytest.fixture
def fresh_probe():
    solvers._nvmath.cache_clear()
    solvers.nvmath_eigen.cache_clear()
    yield
    solvers._nvmath.cache_clear()
    solvers.nvmath_eigen.cache_clear()


def test_without_nvmath_there_is_no_path_and_the_reason_is_given(fresh_probe, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvmath", None)  # an import of it raises ImportError
    assert solvers.nvmath_eigen() is None and solvers.nvmath_unavailable() == "nvmath-python is not installed"
    probe = torch.zeros(1, 2, 2)
    monkeypatch.setattr(stages, "on_gpu", lambda t: True)
    assert "nvmath" not in stages.paths("gram", probe, Policy())
    with pytest.raises(ValueError, match="no 'nvmath' path"):
        stages.chosen_path("gram", probe, Policy(force={"gram": "nvmath"}), (2,))


def test_with_nvmath_but_no_gpu_there_is_no_path(fresh_probe, monkeypatch):
    nvmath, bindings = ModuleType("nvmath"), ModuleType("nvmath.bindings")
    nvmath.bindings = bindings
    for name in ("cublas", "cusolver", "cusolverDn"):
        setattr(bindings, name, ModuleType(f"nvmath.bindings.{name}"))
        monkeypatch.setitem(sys.modules, f"nvmath.bindings.{name}", getattr(bindings, name))
    monkeypatch.setitem(sys.modules, "nvmath", nvmath)
    monkeypatch.setitem(sys.modules, "nvmath.bindings", bindings)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert solvers.nvmath_eigen() is None and solvers.nvmath_unavailable() == "no CUDA device"


def test_a_batch_past_one_calls_limits_is_solved_in_chunks(fake):
    """cuSOLVER takes n * lda * batch below 2**31 per call (and large batches have failed): the batch is
    split within max_elements and max_batch, each chunk at its own offset, its info read back at once."""
    solver = solvers.syev_batched_via(fake, stream_of=lambda device: STREAM, device_guard=fake.device_guard,
                                      max_elements=100, max_batch=3)
    for n, sizes in ((5, [3, 3, 1]), (6, [2, 2, 2, 1])):  # 25 elements a matrix: 4 fit; 36: 2 fit
        fake.calls.clear()
        a = spd((7,), n, seed=n)
        assert_values_close(solver.eigvalsh(a), torch.linalg.eigvalsh(a))
        assert [call[-1] for call in fake.calls] == sizes
    fake.info = {1: 3}  # the second matrix of every chunk of 2, 2, 2, 1: matrices 1, 3 and 5 of the batch
    with pytest.raises(torch.linalg.LinAlgError, match=r"matrix 1 of the batch \(7,\) \(info = 3\); 3 of 7 failed"):
        solver.eigvalsh(spd((7,), 6))


def test_a_cusolver_without_the_symbol_is_absent_and_a_failing_binding_is_broken(caplog):
    """Absent (no XsyevBatched in the loaded cuSOLVER): an optional path left out. Any other failure of
    the small solve is a defect: logged, and the GPU acceptance fails the nvmath checks on it."""
    class FunctionNotFoundError(RuntimeError):  # nvmath's, by name
        pass

    absent = solvers._failed_probe(FunctionNotFoundError("cusolverDnXsyevBatched"))
    assert absent.solver is None and not absent.broken and "12.6 update 2" in absent.reason
    broken = solvers._failed_probe(TypeError("an integer is required"))
    assert broken.solver is None and broken.broken and "TypeError: an integer is required" in broken.reason
    assert "the nvmath eigen path is left out" in caplog.text
