import itertools
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import FakeCupy, assert_matches_reference, padded_batch, random_sequences, tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg import eigen, extension, solvers, stages
from gradspec.linalg.dispatch import MeasuredDispatch, size_bucket
from gradspec.linalg.policy import Policy

FP32_RTOL = 0.3  # fp32 Grams resolve singular values only down to ~sqrt(d * eps32) of the largest

def test_size_bucket_rounds_up_to_a_power_of_two():
    assert [size_bucket(n) for n in (1, 2, 3, 32, 33, 100, 128, 129)] == [1, 2, 4, 32, 64, 128, 128, 256]


def _costed(ticks: itertools.count, calls: dict[str, int]):
    """candidate(name, cost): a candidate that costs `cost` ticks of the fake clock and counts its calls."""
    def candidate(name: str, cost: int):
        def run():
            calls[name] += 1
            for _ in range(cost):  # each tick of the fake clock is one unit of work
                next(ticks)
            return name
        return run
    return candidate


def test_fastest_measures_each_candidate_once_then_runs_the_winner():
    ticks = itertools.count()
    calls = {"slow": 0, "quick": 0}
    candidate = _costed(ticks, calls)
    fastest = MeasuredDispatch(clock=lambda: next(ticks))
    candidates = {"slow": candidate("slow", 5), "quick": candidate("quick", 2)}
    assert fastest.choice("k") is None
    assert fastest.run("k", candidates) == "quick"  # the winner's result, not the last one run
    assert calls == {"slow": 2, "quick": 2}  # a warm-up and a timed run each
    assert fastest.choice("k") == "quick" and fastest.seconds["k"]["slow"] > fastest.seconds["k"]["quick"]
    assert fastest.run("k", candidates) == "quick" and calls == {"slow": 2, "quick": 3}
    assert fastest.run("other", {"slow": candidate("slow", 1), "quick": candidate("quick", 9)}) == "slow"


def test_a_candidate_that_fails_is_left_out_and_logged(caplog):
    def broken():
        raise RuntimeError("no kernel image for this GPU")

    fastest = MeasuredDispatch()
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        assert fastest.run("k", {"triton": broken, "torch": lambda: 3}) == 3
    assert fastest.choice("k") == "torch" and fastest.seconds["k"]["triton"] == float("inf")
    assert "triton path failed" in caplog.text and "no kernel image" in caplog.text
    with pytest.raises(RuntimeError, match="no kernel image"):
        fastest.run("other", {"triton": broken})


def test_a_measurement_waits_for_work_that_holds_the_lock_and_a_measured_key_does_not():
    fastest = MeasuredDispatch()
    fastest.run("known", {"a": lambda: 1})
    holding, release = threading.Event(), threading.Event()

    def worker():
        with fastest.lock:
            holding.set()
            release.wait(5)

    threading.Thread(target=worker).start()
    holding.wait(5)
    assert fastest.run("known", {"a": lambda: 1}) == 1  # no measurement: no wait
    finished = threading.Event()
    threading.Thread(target=lambda: (fastest.run("new", {"a": lambda: 2}), finished.set())).start()
    assert not finished.wait(0.2)  # held back while the lock is held
    release.set()
    assert finished.wait(5) and fastest.choice("new") == "a"


@pytest.fixture
def measured_on_cpu(monkeypatch):
    """Take the GPU's measured dispatch on CPU tensors (the Triton Gram under the interpreter)."""
    monkeypatch.setattr(stages, "on_gpu", lambda t: True)
    dispatch = MeasuredDispatch()
    monkeypatch.setattr(stages, "DISPATCH", dispatch)
    return dispatch


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
@pytest.mark.parametrize(("precision", "gram_paths", "rtol"),
                         [("fp64", {"cpp", "torch", "triton"}, 1e-4), ("fp32", {"triton", "torch"}, FP32_RTOL)])
def test_measured_dispatch_matches_the_reference(measured_on_cpu, precision, gram_paths, rtol):
    """Every stage measured on its first batch among the paths of the configured precision alone
    (never fp32 against fp64); whichever wins, the scores match the reference at that precision's
    tolerance; once a stage is measured, the engine keeps the Grams of torch-won stages where they are."""
    model = tiny_model("llama", vocab=500)
    seqs = random_sequences([5, 17, 40, 90], 500)
    engine = SpectralEngine(model, "all", precision=precision)
    assert_matches_reference(model, engine.score(*padded_batch(seqs)), seqs, "all", rtol=rtol)
    assert {"segment_gram", "core", "gram"} <= {key[0] for key in measured_on_cpu.chosen}
    for key, seconds in measured_on_cpu.seconds.items():
        assert key[1] == precision
        assert set(seconds) == (gram_paths if key[0] == "segment_gram" else {"cpp", "torch"})
    assert set(engine.policy.describe()["paths"]["segment_gram"]) <= gram_paths
    # now the winners alone, with the eigen stage on submit's worker thread as `gradspec score` runs it
    assert_matches_reference(model, engine.submit(*padded_batch(seqs)).result(), seqs, "all", rtol=rtol)
    for (stage, _, *size), won in measured_on_cpu.chosen.items():
        if stage in ("core", "gram"):  # the eigen stages
            grams = torch.zeros(1, size[0], size[0])
            assert eigen.eigen_path(grams, engine.policy, stage) == won
    assert eigen.eigen_path(torch.zeros(1, 300, 300), engine.policy, "core") is None  # not measured yet
    grams = torch.zeros(1, 4, 4)
    assert eigen.eigen_path(grams, "cpp", "core") == "cpp" and eigen.eigen_path(grams, "torch", "core") == "torch"


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_submit_measures_on_the_callers_thread_alone(measured_on_cpu, monkeypatch):
    """A batch that measures an eigen stage is finished by submit itself (timings beside the next
    batch's device work would be off); a batch of measured sizes goes to the worker."""
    timed_on = set()
    monkeypatch.setattr(measured_on_cpu, "clock",
                        lambda: timed_on.add(threading.current_thread().name) or time.perf_counter())
    model = tiny_model("llama", vocab=500)
    seqs = random_sequences([6, 30], 500)
    engine = SpectralEngine(model, "all", overlap=True)
    first = engine.submit(*padded_batch(seqs))
    assert first.done() and timed_on == {threading.current_thread().name}
    assert_matches_reference(model, first.result(), seqs, "all")
    finished_on, free_meanwhile = [], []

    def finish(*work):
        finished_on.append(threading.current_thread().name)
        lock = measured_on_cpu.lock  # a measurement elsewhere would have to wait for this batch
        other = threading.Thread(target=lambda: free_meanwhile.append(lock.acquire(blocking=False)))
        other.start()
        other.join()

    monkeypatch.setattr(engine, "_finish", finish)
    engine.submit(*padded_batch(seqs)).result()
    assert finished_on[0].startswith("gradspec-eigen") and free_meanwhile == [False]


@pytest.fixture
def cupy_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return solvers.eigensolver_via(FakeCupy, FakeCupy.errstate)


def test_the_cupy_eigensolver_gives_torchs_spectra(cupy_on_cpu):
    """Through DLPack, batched over any leading dimensions, in both eigen stages."""
    g = torch.Generator().manual_seed(0)
    X, D = torch.randn(3, 9, 5, generator=g, dtype=torch.float64), torch.randn(3, 2, 9, 4, generator=g)
    B, A = X @ X.mT, (D @ D.mT).double()
    lengths = torch.tensor([9, 7, 4])
    torch.testing.assert_close(eigen._core_device(cupy_on_cpu, B, A, lengths),
                               eigen._core_device(solvers.TORCH_EIGEN, B, A, lengths), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(eigen._gram_device(cupy_on_cpu, A[:, 0]),
                               eigen._gram_device(solvers.TORCH_EIGEN, A[:, 0]), rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_cupy_is_measured_where_installed(measured_on_cpu, cupy_on_cpu, monkeypatch):
    monkeypatch.setattr(solvers, "cupy_eigen", lambda: cupy_on_cpu)
    model = tiny_model("llama", vocab=500)
    seqs = random_sequences([5, 40], 500)
    assert_matches_reference(model, SpectralEngine(model, "all").score(*padded_batch(seqs)), seqs, "all")
    eigen_stages = [s for key, s in measured_on_cpu.seconds.items() if key[0] in ("core", "gram")]
    assert eigen_stages and all(set(s) == {"cpp", "torch", "cupy"} for s in eigen_stages)


def test_cupy_is_not_measured_above_its_size_but_can_still_be_forced(measured_on_cpu, cupy_on_cpu, monkeypatch):
    monkeypatch.setattr(solvers, "cupy_eigen", lambda: cupy_on_cpu)
    monkeypatch.setattr(stages, "MEASURED_UP_TO", {"cupy": 4})
    g = torch.Generator().manual_seed(1)
    Y = torch.randn(3, 6, 9, generator=g, dtype=torch.float64)
    eigen.gram_spectra(Y @ Y.mT, Policy())
    assert "cupy" not in next(iter(measured_on_cpu.seconds.values()))
    forced = Policy(force={"gram": "cupy"})
    eigen.gram_spectra(Y @ Y.mT, forced)
    assert forced.describe()["paths"] == {"gram": ["cupy"]}


def test_measured_lowrank_sketch_matches_the_cpu_path(measured_on_cpu, monkeypatch):
    """At fp32, the sketch's products through the measured path (Triton or torch, both fp32) give
    the CPU path's fp64 answer to fp32 accuracy; the rank covers these short gradients exactly."""
    model = tiny_model("llama", vocab=500)
    batch = padded_batch(random_sequences([5, 4], 500))
    measured = SpectralEngine(model, "attn", method="lowrank", rank=8, precision="fp32").score(*batch)
    assert any(key[0] == "segment_tdot" for key in measured_on_cpu.chosen)
    monkeypatch.setattr(stages, "on_gpu", lambda t: False)  # the plain CPU path
    plain = SpectralEngine(model, "attn", method="lowrank", rank=8).score(*batch)
    for name, values in plain.metrics.items():
        torch.testing.assert_close(measured.metrics[name], values, rtol=1e-4, atol=1e-9)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_a_measured_eigen_stage_out_of_gpu_memory_falls_back_to_the_host(measured_on_cpu, monkeypatch, caplog):
    Y = torch.randn(3, 6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grams = Y @ Y.mT
    want = eigen.gram_spectra(grams, "cpp")
    measured_on_cpu.chosen[("gram", "fp64", 8)] = "torch"

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(eigen, "_gram_device", out_of_memory)
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        got = eigen.gram_spectra(grams)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and "solved on the host" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradspec"):  # a forced device path falls back the same way
        got = eigen.gram_spectra(grams, "torch")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and "solved on the host" in caplog.text


def test_a_candidate_whose_warm_up_already_lost_is_not_run_again():
    """On a lent GPU a slow candidate's second run (CuPy's Jacobi on large Grams, say) would cost minutes."""
    ticks = itertools.count()
    calls = {"quick": 0, "slow": 0}
    candidate = _costed(ticks, calls)
    fastest = MeasuredDispatch(clock=lambda: next(ticks))
    fastest.run("k", {"quick": candidate("quick", 1), "slow": candidate("slow", 100)})
    assert calls == {"quick": 2, "slow": 1} and fastest.choice("k") == "quick" and "k" not in fastest.retry_in
    assert fastest.seconds["k"]["slow"] > 100


def test_unmeasured_work_runs_the_first_candidate_and_leaves_the_choice_open(measured_on_cpu):
    """The memory probes' one-row batches must not choose the paths of every later batch of their key."""
    from gradspec.engine import batch_memory

    ran = []
    candidates = {"a": lambda: ran.append("a") or 1, "b": lambda: ran.append("b") or 2}
    with measured_on_cpu.unmeasured():
        assert measured_on_cpu.run("k", candidates) == 1
        on_another = []  # on a GPU autograd runs the hooks on its own thread: they must see it too
        thread = threading.Thread(target=lambda: on_another.append(measured_on_cpu.run("k", candidates)))
        thread.start()
        thread.join()
    assert ran == ["a", "a"] and on_another == [1] and measured_on_cpu.choice("k") is None
    engine = SpectralEngine(tiny_model("llama", vocab=500), "attn")
    batch_memory.measure(engine, 0)  # its hooks form Grams: the segment_gram stage, open on a "GPU"
    first = stages.paths("segment_gram", torch.zeros(1, 2, 2), engine.policy)[0]
    assert measured_on_cpu.chosen == {} and engine.policy.describe()["paths"]["segment_gram"] == [first]
