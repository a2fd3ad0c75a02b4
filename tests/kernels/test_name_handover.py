"""The repository's kernels/ folder is gradspec.kernels; from the repository's root, `import kernels` must still
be Hugging Face's `kernels` distribution where one is installed (transformers 5.25 on imports it), and
transformers must import from there whether one is or not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (ROOT / "kernels" / "__init__.py").is_file(), reason="not a checkout")


def _import_kernels(extra_path: Path | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__, kernels.MARK)"],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def test_from_the_root_import_kernels_is_the_installed_distribution(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("MARK = 'hugging face'\n")
    (tmp_path / "kernels" / "layer.py").write_text("")
    done = _import_kernels(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "kernels" / "__init__.py"), "hugging", "face"]


def test_from_the_root_transformers_imports_with_or_without_the_distribution():
    """Without Hugging Face's kernels, transformers (its fallback imports a found package that has no metadata)
    meets this folder, as before the hand-over: a hand-over that raised there broke every transformers import."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "from transformers import AutoModelForCausalLM, Trainer"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
