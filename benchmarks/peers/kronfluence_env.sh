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
source "$(dirname "$0")/peer_venv.sh"
usage_out_dir $# "$0"
peer_venv kronfluence "$1"
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" "kronfluence==1.0.1" "transformers$TRANSFORMERS_PIN" pandas pyarrow
"$VPY" -m pip uninstall --quiet -y torchvision
peer_ready kronfluence kronfluence torch transformers accelerate safetensors opt_einsum numpy pandas pyarrow torchvision \
    -- "import kronfluence" "from kronfluence.analyzer import Analyzer" \
    "from transformers import LlamaForCausalLM  # a torchvision left behind fails the model's import"
