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
source "$(dirname "$0")/peer_venv.sh"
peer_venv opacus "${1:-/tmp/gradspec-peers-env}"
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "opacus==1.6.*"
# The model side of the benchmark (transformers' Llama / Qwen3-MoE), at the project's version where known.
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "transformers$TRANSFORMERS_PIN"
peer_ready opacus opacus torch transformers numpy scipy -- "import opacus" "from opacus import GradSampleModule"
