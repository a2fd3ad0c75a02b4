#!/usr/bin/env bash
# Make an isolated virtual environment for Opacus 1.6 (Meta's differential-privacy library,
# https://pypi.org/project/opacus/) so that benchmarks/peers/bench_peers.py can compare gradspec with
# Opacus's per-sample gradients (GradSampleModule). Opacus is NOT a dependency of gradspec: it lives
# only in this venv, outside the repository.
#
#   benchmarks/peers/peers_env.sh [OUT_DIR]        (default /tmp/gradspec-peers-env)
#
# creates OUT_DIR/.venv-opacus and prints its python. bench_peers.py runs its Opacus row as a
# subprocess of that python with PYTHONPATH at the checkout (it imports gradspec's pure-Python parts
# for the model, samples and loss; nothing of the compiled extension).
#
# Order matters, as for bergson_env.sh: the CPU torch 2.13.0 wheel first (pip finds torch-2.13.0+cpu
# on disk here; a plain `torch` requirement resolved later would pull a CUDA build), then opacus 1.6.*
# constrained to keep that torch; then transformers at the version of the checkout's .venv (or
# TRANSFORMERS_VERSION; the newest without either), which the benchmark's models need (Opacus does not).
# Measured on 2026-12-04 (TRANSFORMERS_VERSION=5.25.0): ready in 64 s; see benchmarks/RESULTS.md.
set -euo pipefail

OUT_DIR=${1:-/tmp/gradspec-peers-env}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
VENV="$OUT_DIR/.venv-opacus"
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$OUT_DIR"
start=$(date +%s)

"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip
"$VPY" -m pip install --quiet torch==2.13.0

CONSTRAINTS="$VENV/constraints.txt"
"$VPY" - >"$CONSTRAINTS" <<'PYEOF'
import importlib.metadata as m
print(f"torch=={m.version('torch')}")
PYEOF
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "opacus==1.6.*"
# The model side of the benchmark (transformers' Llama / Qwen3-MoE), at the project's version where known.
TRANSFORMERS=${TRANSFORMERS_VERSION:-$("$HERE/../../.venv/bin/python" -c \
    'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || echo "")}
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "transformers${TRANSFORMERS:+==$TRANSFORMERS}"

"$VPY" - <<'PYEOF'
import importlib.metadata as m
for name in ("opacus", "torch", "transformers", "numpy", "scipy"):
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name}: not installed")
import opacus  # noqa: F401  (the import itself is the check)
from opacus import GradSampleModule  # noqa: F401
print("import opacus: ok")
PYEOF
echo "opacus venv ready in $(( $(date +%s) - start )) s: $VPY"
