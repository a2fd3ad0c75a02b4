#!/usr/bin/env bash
# The GPU suite in one call on a machine that already has torch, Triton and transformers (the
# lent H200's image; CuPy too): build the extension in place for that machine's python3, run the
# suite, keep its log beside the results.
# Usage: bash benchmarks/gpu_run.sh OUT_DIR [gpu_suite.py options]
set -o pipefail
out=${1:-gpu_results}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Without the extension the suite still runs (host eigen paths left out), so a failed build is logged, not fatal.
python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 || echo "extension build failed: see build.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
python3 benchmarks/gpu_suite.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
