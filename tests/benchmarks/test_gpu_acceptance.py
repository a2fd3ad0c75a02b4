"""The GPU acceptance script: its smoke form passes on the CPU, and a failing or raising check fails the verdict."""

import json
import math
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FP32_RTOL, FP64_RTOL

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a package at the root of the checkout

from benchmarks.gpu import gpu_acceptance as acceptance  # noqa: E402

FORCED = {"fp64/host-eigen", "fp64/device-eigen", "fp64/triton-syrk", "fp32/triton-gram", "fp32/torch-gram",
          "fp32/lowrank-triton", "fp32/lowrank-torch"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run (tiny shapes on the CPU, Triton interpreted, no suite), as the GPU machine runs it:
    gpu_run.sh in a bare copy of the tracked files, gradspec not installed (python without site, so no
    editable install's import hooks; site-packages on PYTHONPATH for torch and the rest), the extension
    built here copied in (setup.py then finds it up to date). Its output and results."""
    tree, out, bin_dir = (tmp_path_factory.mktemp(name) for name in ("tree", "acceptance", "bin"))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    for built in (ROOT / "gradspec").glob("_C*.so"):
        shutil.copy(built, tree / "gradspec")  # after the sources: newer than they are
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python3.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    run = subprocess.run(["bash", "benchmarks/gpu/gpu_run.sh", str(out), "--smoke", "--no-suite"], cwd=tree,
                         capture_output=True, text=True, env=env)
    assert (out / "acceptance.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return run, json.loads((out / "acceptance.json").read_text()), (out / "acceptance.md").read_text()


def test_smoke_passes_with_every_check_recorded(smoke):
    run, result, md = smoke
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == result["verdict"] == "ACCEPTANCE: PASS (23 checks)"
    assert last in md
    checks = {c["check"]: c for c in result["checks"]}
    for model in ("tiny-llama", "tiny-qwen2"):
        for config in acceptance.CONFIGS:
            name = f"{model}/{config.name}"
            if config.name == "fp64/cupy-eigen":  # no CuPy here: skipped, which is no failure
                assert checks[name]["status"] == "skipped" and "CuPy" in checks[name]["problems"][0]
                continue
            if config.name == "fp64/nvmath-eigen":  # no nvmath-python nor CUDA here: skipped likewise
                assert checks[name]["status"] == "skipped" and "nvmath" in checks[name]["problems"][0]
                continue
            calls = ("score", "submit") if config.submit else ("score",)
            assert all(checks[f"{name}/{call}"]["status"] == "pass" for call in calls), name
    assert checks["device/launch-on-tensors-gpu"]["status"] == "skipped"
    placed = checks["device/device-map"]  # the host twice here: the dispatch's logic, not two devices
    assert placed["status"] == "pass" and placed["devices"] == ["cpu", "cpu"] and len(placed["max_rel_err"]) == 2
    assert result["suite"] is None and set(result["setup"]) == {"tiny-llama", "tiny-qwen2"}


def test_smoke_errors_are_within_tolerance_on_the_forced_paths(smoke):
    _, result, _ = smoke
    scored = [c for c in result["checks"] if "call" in c]
    assert len(scored) == 22
    for c in scored:
        assert c["samples"] > 0 and c["parts"] > 0 and c["loss_rel_err"] <= acceptance.LOSS_RTOL
        assert all(c["worst"][m] <= c["tolerance"][m] for m in c["worst"]), c["check"]
        assert not c["bad_status"] and not c["problems"]
        if c["config"] in FORCED:
            ran = c["paths"]["paths"]
            assert all(ran[stage] == [path] for stage, path in c["force"].items()), c["check"]
        if c["precision"] == "fp64":
            assert max(c["worst"].values()) <= 1e-4
    judged = {(c["model"], c["precision"], c["method"]): (c["samples"], c["scored"]) for c in scored}
    assert judged == {  # fp64: every sample, the rank-deficient one included; fp32: the full-rank ones of
        # the core path (shorter than k/v's side, 16), the others recorded as not judged; low-rank: <= 16 tokens
        ("tiny-llama", "fp64", "exact"): (5, 5), ("tiny-llama", "fp32", "exact"): (2, 5),
        ("tiny-llama", "fp32", "lowrank"): (3, 3), ("tiny-qwen2", "fp64", "exact"): (3, 3),
        ("tiny-qwen2", "fp32", "exact"): (1, 3), ("tiny-qwen2", "fp32", "lowrank"): (2, 2)}
    assert all("unjudged" in c for c in scored if c["precision"] == "fp32" and c["method"] == "exact")


def test_the_tolerances_are_the_stated_ones():
    assert acceptance.FP64_RTOL == FP64_RTOL and acceptance.FP32_RTOL == FP32_RTOL


def test_a_failing_or_skipped_for_time_check_fails_the_verdict_and_a_skipped_one_does_not():
    ok, skipped = {"check": "a", "status": "pass"}, {"check": "b", "status": "skipped"}
    assert acceptance.verdict([ok, skipped]) == "ACCEPTANCE: PASS (1 checks)"
    for status in ("fail", "error", "not_run"):
        assert acceptance.verdict([ok, {"check": "c", "status": status}]) == "ACCEPTANCE: FAIL: c"
    assert acceptance.verdict([skipped]) == "ACCEPTANCE: FAIL: no check ran"


def test_an_error_above_tolerance_a_nan_or_a_fallback_fails_a_check():
    config = acceptance.Config("fp64/host-eigen", "fp64", {"core": "cpp", "gram": "cpp"})
    base = {"tolerance": acceptance.tolerances(config), "loss_rel_err": 0.0, "bad_status": {},
            "paths": {"precision": "fp64", "paths": {"core": ["cpp"], "gram": ["cpp"]}}}
    worst = dict.fromkeys(acceptance.METRICS, 0.0)
    assert acceptance.verdict_of({**base, "worst": worst}, config)["status"] == "pass"
    for bad in ({"worst": {**worst, "effective_rank": 2e-4}}, {"worst": {**worst, "nuclear_norm": math.nan}},
                {"worst": worst, "bad_status": {1: "zero_gradient"}},
                {"worst": worst, "paths": {"paths": {"core": ["cpp", "torch"], "gram": ["cpp"]}}},
                {"worst": worst, "paths": {"paths": {"core": ["cpp"]}}}):
        judged = acceptance.verdict_of({**base, **bad}, config)
        assert judged["status"] == "fail" and judged["problems"], bad
    assert acceptance.relative_error(math.inf, 1.0) == math.inf


def test_an_exception_in_a_check_is_recorded_not_raised():
    results, info = acceptance.guarded(lambda: [1 / 0])
    assert results is None and info["error"].startswith("ZeroDivisionError") and "1 / 0" in info["traceback"]


def test_the_two_gpu_device_check_is_skipped_without_them():
    check = acceptance.device_check("cpu")
    assert check["status"] == "skipped" and "SKIPPED" in acceptance.summary({"check": "device", **check})


def test_a_failing_reference_fails_its_shapes_checks_and_the_run_goes_on(tmp_path, monkeypatch):
    """The references are computed on a host thread: an exception there reaches every check that
    compares with them, as that check's error, and the shape's reference time is recorded as NaN."""
    from concurrent.futures import ThreadPoolExecutor

    def broken(*args):
        raise RuntimeError("SVD did not converge")

    monkeypatch.setattr(acceptance, "references_of", broken)
    monkeypatch.setattr(acceptance, "CONFIGS", acceptance.CONFIGS[:1])
    args = acceptance.parse(["--smoke", "--no-suite", "--out", str(tmp_path)])
    report = acceptance.Report(tmp_path, {}, {})
    problem = acceptance.SMOKE_PROBLEMS[1]
    with ThreadPoolExecutor(1) as host:
        prepared = acceptance.guarded(lambda: [acceptance.prepare(problem, "cpu", host)])
        acceptance.run_problem(problem, prepared, args, report, time.perf_counter() + 60)
    assert [c["status"] for c in report.checks] == ["error"]
    assert "SVD did not converge" in report.checks[0]["error"]
    assert math.isnan(report.result["setup"][problem.name]["reference"])


def test_an_absent_nvmath_is_skipped_and_a_broken_one_fails(monkeypatch):
    """nvmath-python is optional, but a binding that is there and fails its small solve is a defect: its
    checks must not pass as 'skipped'."""
    from gradspec.linalg import solvers

    config = next(c for c in acceptance.CONFIGS if c.name == "fp64/nvmath-eigen")
    monkeypatch.setattr(solvers, "nvmath_unavailable", lambda: "some reason")
    for broken, status in ((False, "skipped"), (True, "fail")):
        monkeypatch.setattr(solvers, "nvmath_broken", lambda broken=broken: broken)
        assert acceptance.unavailable(config, "cpu") == (status, "no nvmath path for core: some reason")
