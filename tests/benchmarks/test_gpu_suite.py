import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a package at the root of the checkout

from benchmarks.gpu import gpu_suite  # noqa: E402


def test_gpu_suite_smoke_runs_on_cpu(tmp_path):
    """The GPU suite's reduced form: tiny shapes on the CPU, every configuration measured."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the kernel section runs on the CPU through the interpreter
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_suite", "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert len(rows) == 4 and all("skipped" not in r for r in rows)
    assert [(r["T"], r["modules"]) for r in rows] == [(16, "attn"), (16, "all"), (32, "attn"), (32, "all")]
    for r in rows:
        assert r["gradspec_tokens_s"] > 0 and r["pipelined_tokens_s"] > 0 and r["train_step_tokens_s"] > 0
        assert r["vs_reference"] > 0
        assert r["reference_kind"] == "measured (2 samples)"  # the tiny model's reference is cheap: measured
        # the cost model's prediction beside the measurement, finite
        for key in ("predicted_samples_s", "predicted_pipelined_samples_s", "predicted_train_step_samples_s"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["predicted_placement"] == {"core": "host", "gram": "host"}  # on the CPU
        assert set(r["predicted_stages_s"]) == {"floor", "fp64 grams", "cores and eigen (host)", "copies to the host"}
    rates = result["cost_model"]["rates"]
    assert result["cost_model"]["label"].startswith("prediction") and rates["device"] == "cpu"
    md = (tmp_path / "results.md").read_text()
    assert "| tiny | 16 |" in md and "| predicted (cost model) |" in md and "(measured (2 samples))" in md
    assert result["dispatch"] == []  # the measured dispatch applies on a GPU only
    assert result["environment"]["torch"] == torch.__version__
    # every launch the dispatch can make, each once (one smoke shape), against its torch path
    from gradspec.linalg.triton_launches import triton_launches

    kernels = result["kernels"]
    assert sorted(k["kernel"] for k in kernels) == sorted(t.label for t in triton_launches())
    for k in kernels:
        assert "error" not in k and k["max_rel_err"] < 1e-5 and k["triton_ms"] > 0, k
    eigen = {e["path"]: e for e in result["eigen"]}
    assert set(eigen) == {"cpp", "torch", "triton_jacobi"}  # no CuPy here
    assert all(e["ms"] > 0 and e["max_rel_err"] < 1e-10 for e in eigen.values())


def test_gpu_suite_plan_puts_every_model_at_512_first():
    """Every model at T = 512 before any longer T, the largest first; Llama-3-8B never at T >= 1024."""
    pairs = gpu_suite.plan(gpu_suite.SHAPES, gpu_suite.LENGTHS)
    assert pairs[:3] == [("Llama-3-8B", 512), ("Qwen2.5-1.5B", 512), ("SmolLM2-135M", 512)]
    assert ("Llama-3-8B", 1024) not in pairs and all(T < 1024 for name, T in pairs if name == "Llama-3-8B")
    assert {T for _, T in pairs[3:]} <= {1024, 256} and pairs[3][1] == 1024


def test_a_row_is_written_before_its_reference_and_kept_when_the_reference_fails(tmp_path, monkeypatch):
    """The reference (full fp64 SVDs: the slow part on a GPU) runs after the row is on disk; where it
    fails, the row keeps its measurements and says so in its reference column."""
    import argparse

    written = []

    def failing_reference(*args):
        written.append(json.loads(json.dumps(rows)))  # what was on disk when the reference started
        raise RuntimeError("cusolver error")

    monkeypatch.setattr(gpu_suite, "reference_columns", failing_reference)
    args = argparse.Namespace(smoke=True, device="cpu", dtype="float32", batch_tokens=64, reps=1)
    rows: list[dict] = []
    gpu_suite.run(args, lambda rows: None, [("tiny", 16)], rows, gpu_suite.RowBudget(60))
    assert [r["modules"] for r in rows] == ["attn", "all"] and len(written) == 2
    assert all(w[-1]["gradspec_samples_s"] > 0 and "reference_kind" not in w[-1] for w in written)
    for r in rows:
        assert r["gradspec_samples_s"] > 0 and r["reference_kind"].startswith("failed: RuntimeError: cusolver error")
        assert "vs_reference" not in r
    assert "failed: RuntimeError" in gpu_suite.markdown({"environment": {}, "rows": rows})
