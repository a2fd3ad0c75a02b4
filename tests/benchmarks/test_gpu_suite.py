import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_suite_smoke_runs_on_cpu(tmp_path):
    """The GPU suite's reduced form: tiny shapes on the CPU, every configuration measured."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the kernel section runs on the CPU through the interpreter
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, env=env)
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert len(rows) == 4 and all("skipped" not in r for r in rows)
    for r in rows:
        assert r["gradspec_tokens_s"] > 0 and r["pipelined_tokens_s"] > 0 and r["train_step_tokens_s"] > 0
        assert r["vs_reference"] > 0
    assert "| tiny | 16 |" in (tmp_path / "results.md").read_text()
    assert result["dispatch"] == []  # the measured dispatch applies on a GPU only
    assert result["environment"]["torch"] == torch.__version__
    gram, tdot = result["kernels"]
    assert gram["kernel"] == "segment_gram" and gram["max_rel_err"] < 1e-5 and gram["triton_ms"] > 0
    assert tdot["kernel"] == "segment_tdot_k16" and tdot["max_rel_err"] < 1e-5 and tdot["triton_ms"] > 0
    eigen = {e["path"]: e for e in result["eigen"]}
    assert set(eigen) == {"cpp", "torch", "triton_jacobi"}  # no CuPy here
    assert all(e["ms"] > 0 and e["max_rel_err"] < 1e-10 for e in eigen.values())
