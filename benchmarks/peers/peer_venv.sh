# Sourced by the *_env.sh scripts: the one way a peer's virtual environment is made (bash, set -euo pipefail).
#
#   peer_venv NAME OUT_DIR      # OUT_DIR/.venv-NAME with the CPU torch 2.13.0 and a constraints file keeping it
#   ...                         # "$VPY" -m pip install -c "$CONSTRAINTS" the peer, "transformers$TRANSFORMERS_PIN"
#   peer_ready NAME PKG ... -- IMPORT_LINE ...   # print the versions, run the imports that check it, say done
#
# Order matters: the CPU torch 2.13.0 wheel first (pip finds torch-2.13.0+cpu on disk here; a plain `torch`
# requirement resolved later would pull the CUDA build and its nvidia-* wheels), then the peer constrained so
# that pip keeps that torch. TRANSFORMERS_PIN: "==" the version of the checkout's .venv (or TRANSFORMERS_VERSION),
# empty where neither is known. The venv is made from OUT_DIR, not the repository's root: nothing of the
# checkout belongs on its path while pip runs (the top-level kernels/ would stand for Hugging Face's).

peer_venv() {
    local name=$1
    mkdir -p "$2"
    OUT_DIR=$(cd "$2" && pwd)
    VENV="$OUT_DIR/.venv-$name"
    VPY="$VENV/bin/python"
    CONSTRAINTS="$VENV/constraints.txt"
    local repo
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    local version=${TRANSFORMERS_VERSION:-$("$repo/.venv/bin/python" -c \
        'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || echo "")}
    TRANSFORMERS_PIN=${version:+==$version}
    cd "$OUT_DIR"
    PEER_START=$(date +%s)
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VPY" -m pip install --quiet --upgrade pip
    "$VPY" -m pip install --quiet torch==2.13.0
    "$VPY" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' >"$CONSTRAINTS"
}

peer_ready() {
    local name=$1 imports=() packages=()
    shift
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do packages+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    imports=("$@")
    "$VPY" - "${packages[@]}" <<'PYEOF'
import importlib.metadata as m
import sys
for name in sys.argv[1:]:
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name}: not installed")
PYEOF
    local line
    for line in "${imports[@]}"; do
        "$VPY" -c "$line"  # the import itself is the check
    done
    echo "import $name: ok"
    echo "$name venv ready in $(( $(date +%s) - PEER_START )) s: $VPY"
}

usage_out_dir() {  # the one OUT_DIR argument every *_env.sh takes
    if [ "$1" -ne 1 ]; then
        echo "usage: $2 OUT_DIR" >&2
        exit 2
    fi
}
