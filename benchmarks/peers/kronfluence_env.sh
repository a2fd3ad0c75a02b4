#!/usr/bin/env bash
# Make an isolated virtual environment for kronfluence 1.0.1 (Anthropic/Juhan Bae's influence functions
# with EK-FAC, https://pypi.org/project/kronfluence/) so that benchmarks/peers/kronfluence_scores.py can
# put its scores on validate's retrains beside gradspec's. kronfluence is NOT a dependency of gradspec:
# it lives only in this venv.
#
#   benchmarks/peers/kronfluence_env.sh OUT_DIR
#
# creates OUT_DIR/.venv-kronfluence and prints its python. Then run e.g.
#   OUT_DIR/.venv-kronfluence/bin/python benchmarks/peers/kronfluence_scores.py --help
#
# Order matters, as for bergson_env.sh: the CPU torch 2.13.0 wheel first (pip finds torch-2.13.0+cpu on
# disk here; a plain `torch` requirement resolved later would pull the CUDA build and its nvidia-* wheels),
# then kronfluence==1.0.1 with its requirements (accelerate, transformers, safetensors, opt_einsum, ...)
# constrained so that pip keeps that torch; then transformers at the version of the checkout's .venv (or
# TRANSFORMERS_VERSION), which reads the project's models, and pyarrow + pandas for the parquet written.
# kronfluence_scores.py imports gradspec's pure-Python reader, template and loss with PYTHONPATH at the
# checkout (nothing of the compiled extension).
# kronfluence 1.0.1 lists torchvision as a requirement but imports it nowhere. pip resolves it to
# torchvision 0.28.0, whose compiled ops do not load with the CPU torch: transformers then fails at the
# model's import with `ModuleNotFoundError: Could not import module 'LlamaConfig'` (underneath:
# RuntimeError: operator torchvision::nms does not exist). So it is uninstalled again afterwards, as
# bergson_env.sh does; transformers skips what is absent.
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
VENV="$OUT_DIR/.venv-kronfluence"
HERE=$(cd "$(dirname "$0")" && pwd)
# Not from the repository's root: nothing of the checkout belongs on the venv's path while pip runs.
cd "$OUT_DIR"
start=$(date +%s)

"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip
"$VPY" -m pip install --quiet torch==2.13.0

# Keep pip from replacing the CPU torch while resolving kronfluence's requirements.
CONSTRAINTS="$VENV/constraints.txt"
"$VPY" - >"$CONSTRAINTS" <<'PYEOF'
import importlib.metadata as m
print(f"torch=={m.version('torch')}")
PYEOF
TRANSFORMERS=${TRANSFORMERS_VERSION:-$("$HERE/../../.venv/bin/python" -c \
    'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || echo "")}
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "kronfluence==1.0.1" \
    "transformers${TRANSFORMERS:+==$TRANSFORMERS}" pandas pyarrow
"$VPY" -m pip uninstall --quiet -y torchvision

"$VPY" - <<'PYEOF'
import importlib.metadata as m
for name in ("kronfluence", "torch", "transformers", "accelerate", "safetensors", "opt_einsum", "numpy",
             "pandas", "pyarrow", "torchvision"):
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name}: not installed")
import kronfluence  # noqa: F401  (the import itself is the check)
from kronfluence.analyzer import Analyzer  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401  (the model's import: a torchvision left behind fails it)
print("import kronfluence: ok")
PYEOF
echo "kronfluence venv ready in $(( $(date +%s) - start )) s: $VPY"
