#!/usr/bin/env bash
# Make an isolated virtual environment for dattri 0.3.0 (TRAIS-Lab's library of data attribution methods,
# https://pypi.org/project/dattri/) so that benchmarks/peers/dattri_scores.py can put its TracIn, TRAK and
# LoGra scores on validate's retrains beside gradspec's. dattri is NOT a dependency of gradspec: it lives
# only in this venv.
#
#   benchmarks/peers/dattri_env.sh OUT_DIR
#
# creates OUT_DIR/.venv-dattri and prints its python. Then run e.g.
#   OUT_DIR/.venv-dattri/bin/python benchmarks/peers/dattri_scores.py --help
#
# Order matters, as for bergson_env.sh: the CPU torch 2.13.0 wheel first (pip finds torch-2.13.0+cpu on
# disk here; a plain `torch` requirement resolved later would pull the CUDA build and its nvidia-* wheels),
# then dattri==0.3.0 with its requirements, constrained so that pip keeps that torch; then transformers at
# the version of the checkout's .venv (or TRANSFORMERS_VERSION), which reads the project's models, and
# pandas + pyarrow for the parquet written. dattri_scores.py imports gradspec's pure-Python tokenization
# with PYTHONPATH at the checkout. dattri's CUDA projector (fast_jl) is not installed: on the CPU dattri
# projects with its basic (dense Gaussian/Rademacher) projector.
#
# Measured on 2026-12-08 (2 cores, AMD EPYC): see benchmarks/RESULTS.md.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT_DIR=$(cd "$1" && pwd)
PY=${PYTHON:-python3}
VENV="$OUT_DIR/.venv-dattri"
HERE=$(cd "$(dirname "$0")" && pwd)
# Not from the repository's root: nothing of the checkout belongs on the venv's path while pip runs.
cd "$OUT_DIR"
start=$(date +%s)

"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip
"$VPY" -m pip install --quiet torch==2.13.0

# Keep pip from replacing the CPU torch while resolving dattri's requirements.
CONSTRAINTS="$VENV/constraints.txt"
"$VPY" - >"$CONSTRAINTS" <<'PYEOF'
import importlib.metadata as m
print(f"torch=={m.version('torch')}")
PYEOF
TRANSFORMERS=${TRANSFORMERS_VERSION:-$("$HERE/../../.venv/bin/python" -c \
    'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || echo "")}
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "dattri==0.3.0" \
    "transformers${TRANSFORMERS:+==$TRANSFORMERS}" pandas pyarrow

"$VPY" - <<'PYEOF'
import importlib.metadata as m
for name in ("dattri", "torch", "transformers", "numpy", "pandas", "pyarrow", "fast_jl"):
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name}: not installed")
import dattri  # noqa: F401  (the import itself is the check)
from dattri.task import AttributionTask  # noqa: F401
print("import dattri: ok")
PYEOF
echo "dattri venv ready in $(( $(date +%s) - start )) s: $VPY"
