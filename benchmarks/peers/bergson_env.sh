#!/usr/bin/env bash
# Make an isolated virtual environment for bergson 2.5.1 (EleutherAI's data
# attribution library, https://pypi.org/project/bergson/) so that the
# benchmarks can compare gradspec's `align` with bergson's own scores.
# bergson is NOT a dependency of gradspec: it lives only in this venv.
#
#   benchmarks/peers/bergson_env.sh OUT_DIR
#
# creates OUT_DIR/.venv-bergson and prints its python.  Then run e.g.
#   OUT_DIR/.venv-bergson/bin/python benchmarks/peers/bergson_scores.py --help
#
# Order matters: the CPU torch 2.13.0 wheel is installed first (on this
# workplace pip finds torch-2.13.0+cpu on disk; a plain `torch` requirement
# resolved later would pull the CUDA build and its nvidia-* wheels), then
# bergson==2.5.1 with its requirements, constrained so pip keeps that torch.
# bergson 2.5.1 lists torchvision and torchaudio as requirements but imports
# neither (nor bitsandbytes) anywhere.  pip resolves them to torchvision 0.28.0
# and torchaudio 2.11.1, whose compiled ops do not load with the CPU torch:
# transformers then fails at `import bergson` with
#   ModuleNotFoundError: Could not import module 'PreTrainedModel'
# (underneath: RuntimeError: operator torchvision::nms does not exist).
# So they are uninstalled again afterwards; transformers skips what is absent.
#
# Measured on 2026-12-03 (2 cores, AMD EPYC): see benchmarks/RESULTS.md.
set -euo pipefail
source "$(dirname "$0")/peer_venv.sh"
usage_out_dir $# "$0"
peer_venv bergson "$1"
"$VPY" -m pip install -c "$CONSTRAINTS" "bergson==2.5.1"
"$VPY" -m pip uninstall -y torchvision torchaudio
peer_ready bergson bergson torch transformers datasets accelerate peft torchvision torchaudio bitsandbytes pyarrow \
    -- "import bergson"
