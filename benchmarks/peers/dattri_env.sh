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
source "$(dirname "$0")/peer_venv.sh"
usage_out_dir $# "$0"
peer_venv dattri "$1"
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "dattri==0.3.0" "transformers$TRANSFORMERS_PIN" pandas pyarrow
peer_ready dattri dattri torch transformers numpy pandas pyarrow fast_jl -- "import dattri" \
    "from dattri.task import AttributionTask"
