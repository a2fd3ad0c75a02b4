"""Faults in the eigen stage never end a run: a failing path is retried on the host, what still
fails is solved sample by sample, and only a sample that fails alone is flagged (eigen_failed)."""

import itertools
import logging

import pytest
import torch
from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model

from gradspec.engine import capture
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg import eigen, extension, solvers
from gradspec.linalg.dispatch import RETRY_AFTER, MeasuredDispatch

VOCAB = 500
LENGTHS = [5, 17, 40, 90]  # both eigen stages: the core (T < 32) and the materialised Grams


def _failing(real, fault: type[BaseException], when):
    def solve(*args, **kwargs):
        if when(args):
            raise fault("injected")
        return real(*args, **kwargs)
    return solve


FAULTS = [torch.OutOfMemoryError, torch.linalg.LinAlgError]
if extension.BUILT:
    FAULTS.append(extension.C.LapackError)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("run", ["score", "submit"])
def test_a_batch_that_fails_everywhere_is_solved_sample_by_sample(monkeypatch, fault, run):
    """Every path fails on any batch of more than one sample (on the caller's thread or the
    worker's): each sample alone still gets its exact scores."""
    many = lambda args: args[-1].shape[0] > 1 if isinstance(args[0], solvers.Eigensolver) else args[0].shape[0] > 1  # noqa: E731
    for name in ("_core_cpp", "_core_device", "_gram_cpp", "_gram_device"):
        monkeypatch.setattr(eigen, name, _failing(getattr(eigen, name), fault, many))
    for joint in ("host_core_spectra", "host_gram_spectra"):  # a batch's groups or materialised parts in one job
        monkeypatch.setattr(capture, joint, _failing(getattr(capture, joint), fault, lambda args: True))
    model = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences(LENGTHS, VOCAB)
    engine = SpectralEngine(model, "all")
    batch = padded_batch(seqs)
    scores = engine.score(*batch) if run == "score" else engine.submit(*batch).result()
    assert_matches_reference(model, scores, seqs, "all")


def test_a_sample_that_fails_alone_is_flagged_and_the_others_kept(monkeypatch, caplog):
    poisoned = 40  # the sample of 40 tokens fails on every path, alone or not

    def has_poisoned(args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        lengths = tensors[2] if len(tensors) == 3 else None  # core stages carry the lengths
        return lengths is not None and bool((lengths == poisoned).any())

    for name in ("_core_cpp", "_core_device"):
        monkeypatch.setattr(eigen, name, _failing(getattr(eigen, name), eigen.eigen_faults()[1], has_poisoned))
    jointly = _failing(capture.host_core_spectra, eigen.eigen_faults()[1],  # the batch's inputs in one job
                       lambda args: any(bool((lengths == poisoned).any()) for _, _, lengths, _ in args[0]))
    monkeypatch.setattr(capture, "host_core_spectra", jointly)
    model = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences(LENGTHS, VOCAB)
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        scores = SpectralEngine(model, "all").submit(*padded_batch(seqs)).result()
    bad = LENGTHS.index(poisoned)
    assert "eigen_failed" in scores.status(bad)
    assert any(torch.isnan(m[bad]).all() for m in scores.metrics.values())
    assert "one by one" in caplog.text
    others = [i for i in range(len(seqs)) if i != bad]
    fine = type(scores)(scores.loss[others], scores.num_response_tokens[others], [scores.flags[i] for i in others],
                        {k: v[others] for k, v in scores.metrics.items()})
    assert_matches_reference(model, fine, [seqs[i] for i in others], "all")


def test_a_candidate_that_failed_is_measured_again_later():
    ticks = itertools.count()
    fastest = MeasuredDispatch(clock=lambda: next(ticks))
    broken = {"yes": True}

    def flaky():
        if broken["yes"]:
            raise torch.OutOfMemoryError("transient")
        return "flaky"

    def slow():
        for _ in range(5):
            next(ticks)
        return "slow"

    candidates = {"flaky": flaky, "slow": slow}
    assert fastest.run("k", candidates) == "slow"
    broken["yes"] = False
    for _ in range(RETRY_AFTER - 1):  # batches
        fastest.tick()
        assert fastest.choice("k") == "slow" and fastest.run("k", candidates) == "slow"
    fastest.tick()
    assert fastest.choice("k") is None  # open again: the next call measures
    assert fastest.run("k", candidates) == "flaky"  # re-measured: the faster path is back
    assert fastest.choice("k") == "flaky" and "k" not in fastest.retry_in


class _OnGpu:
    """A Gram that says it lies on a GPU; its host copy is real."""

    is_cuda = True

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def cpu(self) -> torch.Tensor:
        return self.t


def test_out_of_gpu_memory_around_the_solve_is_solved_on_the_host_after_freeing_the_attempt(caplog):
    """Stacking or zeroing a batch's Grams on the GPU can run out of memory outside the eigen stage's own
    retries: solved again on host copies, once the failed attempt's tensors are free (not while the
    exception's frames still hold them)."""
    import weakref

    attempts, alive = [], []

    def solved(*grams):
        attempts.append(grams)
        alive.append([r for r in attempts_refs if r() is not None])
        if len(attempts) == 1:
            held = torch.zeros(1000)  # the failed attempt's memory, referenced by its frame
            attempts_refs.append(weakref.ref(held))
            raise torch.OutOfMemoryError("CUDA out of memory")
        return sum(float(g.sum()) for g in grams)

    attempts_refs: list = []
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        got = capture._on_host_if_out_of_memory(solved, _OnGpu(torch.ones(3)), _OnGpu(torch.ones(2)))
    assert got == 5.0 and len(attempts) == 2 and alive[1] == [] and "solving it on the host" in caplog.text
    with pytest.raises(torch.OutOfMemoryError):  # on the host already: nothing to fall back to
        capture._on_host_if_out_of_memory(lambda g: (_ for _ in ()).throw(torch.OutOfMemoryError("host")),
                                          torch.ones(2))




def test_a_path_that_failed_is_measured_again_after_batches_even_where_the_host_won(monkeypatch):
    """The count is of batches (each BatchCapture.to_host ticks the dispatch once), not of calls of a
    stage on a GPU tensor: where the host's path won, the Grams go to the host and no later call would
    count. Once due, the choice is open, so the engine keeps that batch's Grams where every path can
    run and measures them again."""
    from gradspec.linalg import stages

    monkeypatch.setattr(stages, "on_gpu", lambda t: True)
    monkeypatch.setattr(stages, "DISPATCH", MeasuredDispatch())
    broken = {"yes": True}
    real = eigen._core_device

    def core_device(*args, **kwargs):
        if broken["yes"]:
            raise torch.OutOfMemoryError("beside another batch")
        return real(*args, **kwargs)

    monkeypatch.setattr(eigen, "_core_device", core_device)
    model = tiny_model("llama", vocab=VOCAB)
    batch = padded_batch(random_sequences([5, 17], VOCAB))
    engine = SpectralEngine(model, "attn")
    engine.score(*batch)  # measures every stage: the core's torch path fails, cpp wins
    core = [key for key in stages.DISPATCH.retry_in if key[0] == "core"]
    assert core and all(stages.DISPATCH.chosen[key] == "cpp" for key in core)
    broken["yes"] = False
    for _ in range(RETRY_AFTER - 1):
        engine.score(*batch)
        assert all(stages.DISPATCH.choice(key) == "cpp" for key in core)
    engine.score(*batch)  # its to_host finds the choice open, and measures again
    assert all(key not in stages.DISPATCH.retry_in and stages.DISPATCH.seconds[key]["torch"] < float("inf")
               for key in core)
