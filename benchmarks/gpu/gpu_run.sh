#!/usr/bin/env bash
# GPU acceptance and the throughput suite in one call, on a machine that already has torch, Triton and
# transformers (the lent H200's image; CuPy too): build the extension in place for that machine's
# python3, then benchmarks/gpu/gpu_acceptance.py, which checks every path against the CPU fp64 reference,
# prints its verdict and then runs benchmarks/gpu/gpu_suite.py with the rest of its --budget-s (the suite
# measures the cost model's rates first, then every model at T = 512, its tables, then longer T).
# Usage: bash benchmarks/gpu/gpu_run.sh OUT_DIR [gpu_acceptance.py options, which override the ones below]
#
# Fitted to a lent GPU: 15 minutes of device time in all, start-up included, one call at most 8 minutes.
# The whole call ends within GPU_RUN_S seconds (default 465), so one device call with timeout_s 480-560
# fits, leaving start-up (a few minutes) and a shorter rerun (GPU_RUN_S=200, say) in the 15:
#   - correctness first: model shapes not started within --correctness-s 120 are not run, and a started
#     one gets gpu_acceptance's STARTED_GRACE_S (60 s) more: about 180 s of checks;
#   - the suite gets the rest (gpu_acceptance's --budget-s counts from its own start, so the build's time
#     and python's start-up are taken off here); gpu_acceptance cuts it at --budget-s, and results.json
#     keeps every row it measured.
# OUT_DIR gets build.txt, gpu.txt, log.txt, acceptance.json/.md and results.json/.md (7 files).
# The exit status is the acceptance verdict's: 0 for PASS, 1 for FAIL.
set -o pipefail
out=${1:-gpu_results}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# fp32 matmuls stay fp32: an image may force TF32 on cuBLAS whatever torch is told (NGC's do, by this variable).
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE
export NVIDIA_TF32_OVERRIDE=0
# The tree arrives as a checkout, not an install: gradspec.kernels is the top-level kernels/ folder (setup.py's
# package_dir maps it in an install), so a link stands in for that mapping here.
[ -e gradspec/kernels ] || ln -s ../kernels gradspec/kernels
# Without the extension the run still goes on (its host-eigen checks fail), so a failed build is logged, not fatal.
# Where setup.py cannot build (a setuptools older than pyproject.toml's metadata, say), g++ builds it directly.
if ! python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1; then
    suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    includes=$(python3 -m pybind11 --includes 2>/dev/null) || includes="-I$(python3 -c 'import os, torch; \
print(os.path.join(os.path.dirname(torch.__file__), "include"))') -I$(python3 -c 'import sysconfig; \
print(sysconfig.get_paths()["include"])')"
    echo "setup.py failed; g++ with $includes" >>"$out/build.txt"
    # shellcheck disable=SC2086  # the include flags are words
    g++ -O3 -fopenmp -shared -fPIC -std=c++17 $includes csrc/spectral.cpp -o "gradspec/_C$suffix" >>"$out/build.txt" 2>&1 \
        || echo "extension build failed: see build.txt"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
startup_s=15  # python, torch and transformers imported before gpu_acceptance's clock starts
budget_s=$(( ${GPU_RUN_S:-465} - SECONDS - startup_s ))
(( budget_s < 120 )) && budget_s=120
echo "gpu_run.sh: build ${SECONDS} s; gpu_acceptance --budget-s ${budget_s}" | tee "$out/log.txt"
python3 -m benchmarks.gpu.gpu_acceptance --out "$out" --budget-s "$budget_s" --correctness-s 120 --suite-sections-s 90 \
    "$@" 2>&1 | tee -a "$out/log.txt"
