"""The peers' scores from the project's own venv, for a docs or benchmark script: each function makes the
peer's venv where it is missing (its *_env.sh, under OUT), runs the peer's driver there as a subprocess with
PYTHONPATH at the checkout, and returns the attribution file `gradspec validate --scores` reads (the JSON
with the wall time and peak memory beside it: peer_files.sidecar_path). A file already there is kept (a
stopped evidence run is run again with the same command).

    from benchmarks.peers.peer_runs import dattri, kronfluence      # REPO on sys.path
    kronfluence(out, pool, target, max_length=256)                  # EK-FAC, q/k/v/o
    dattri(out, pool, target, "logra", 256, "--proj-dim", "256")       # max_length 256

KRONFLUENCE_PYTHON / DATTRI_PYTHON name a venv's python made elsewhere (then no venv is made here).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "benchmarks" / "peers"


def _python(out: Path, tool: str) -> str:
    """The peer's venv python: $TOOL_PYTHON, else OUT/TOOL/.venv-TOOL, made by TOOL_env.sh where missing."""
    python = os.environ.get(f"{tool.upper()}_PYTHON") or str(out / tool / f".venv-{tool}" / "bin" / "python")
    if not Path(python).exists():
        _run("bash", str(PEERS / f"{tool}_env.sh"), str(out / tool))
    return python


def _run(*command: str, cwd: Path | None = None) -> None:
    """command with PYTHONPATH at the checkout, in cwd (made where missing: a peer may write files of its own
    in its working folder, dattri's LoGra a batch_metadata.json, which belong beside its scores)."""
    print("$", " ".join(command), flush=True)
    if cwd is not None:
        cwd.mkdir(parents=True, exist_ok=True)
    subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=cwd)


def kronfluence(out: Path, pool: Path, target: Path, max_length: int, *extra: str, factors: str = "ekfac",
                modules: str = "q_proj,k_proj,v_proj,o_proj", model: str | None = None) -> Path:
    """kronfluence's pairwise scores (--factors ekfac by default) as OUT/kronfluence_FACTORS.parquet; extra:
    more kronfluence_scores.py options (--damping, --empirical-fisher, --batch-size)."""
    out, pool, target = Path(out).resolve(), Path(pool).resolve(), Path(target).resolve()  # it runs in its folder
    path = out / f"kronfluence_{factors}.parquet"
    if not path.exists():
        _run(_python(out, "kronfluence"), str(PEERS / "kronfluence_scores.py"), "--model", model or _model(),
             "--pool", str(pool), "--target", str(target), "--out", str(path), "--max-length", str(max_length),
             "--modules", modules, "--factors", factors, "--workdir", str(out / "kronfluence" / factors), *extra,
             cwd=out / "kronfluence" / factors)
    return path


def dattri(out: Path, pool: Path, target: Path, method: str, max_length: int, *extra: str,
           modules: str = "q_proj,k_proj,v_proj,o_proj", model: str | None = None) -> Path:
    """dattri's METHOD (tracin, trak, logra) scores as OUT/dattri_METHOD.parquet; extra: more
    dattri_scores.py options (--proj-dim, --proj-type, --regularization, --damping, --batch-size)."""
    out, pool, target = Path(out).resolve(), Path(pool).resolve(), Path(target).resolve()  # it runs in its folder
    path = out / f"dattri_{method}.parquet"
    if not path.exists():
        _run(_python(out, "dattri"), str(PEERS / "dattri_scores.py"), "--method", method, "--model",
             model or _model(), "--pool", str(pool), "--target", str(target), "--out", str(path), "--max-length",
             str(max_length), "--modules", modules, *extra, cwd=out / "dattri" / method)
    return path


def _model() -> str:
    from gradspec.data.models import default_model_path

    return str(default_model_path())
