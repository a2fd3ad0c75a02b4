#!/usr/bin/env bash
# GPU acceptance and the throughput suite in one call, on a machine that already has torch, Triton and
# transformers (the lent H200's image; CuPy too): build the extension in place for that machine's
# python3, then benchmarks/gpu_acceptance.py, which checks every path against the CPU fp64 reference,
# prints its verdict and then runs benchmarks/gpu_suite.py with the rest of its --budget-s.
# Usage: bash benchmarks/gpu_run.sh OUT_DIR [gpu_acceptance.py options]
# On the lent H200, one device call with timeout_s about 560: bash benchmarks/gpu_run.sh $OUT
# OUT_DIR gets build.txt, gpu.txt, log.txt, acceptance.json/.md and results.json/.md (7 files).
# The exit status is the acceptance verdict's: 0 for PASS, 1 for FAIL.
set -o pipefail
out=${1:-gpu_results}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Without the extension the run still goes on (its host-eigen checks fail), so a failed build is logged, not fatal.
python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 || echo "extension build failed: see build.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
python3 benchmarks/gpu_acceptance.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
