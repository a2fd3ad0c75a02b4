"""The commands a summary suggests run as printed: after set-up only .venv/bin/gradspec may exist."""

import subprocess
import sys

import pytest

from gradspec.invocation import program


@pytest.mark.parametrize(("argv0", "on_path", "said"), [
    (".venv/bin/gradspec", None, ".venv/bin/gradspec"),  # set up, not activated
    ("/opt/env/bin/gradspec", "/opt/env/bin/gradspec", "gradspec"),  # activated, or installed
    ("/opt/env/bin/gradspec", "/usr/bin/gradspec", "/opt/env/bin/gradspec"),  # another gradspec comes first
    ("/my tools/bin/gradspec", None, "'/my tools/bin/gradspec'"),  # quoted for a shell
    ("/site/gradspec/__main__.py", None, "python -m gradspec"),
    ("/usr/bin/pytest", "/usr/bin/gradspec", "gradspec"),  # from Python: the command as installed
])
def test_the_program_is_named_as_the_user_ran_it(monkeypatch, argv0, on_path, said):
    monkeypatch.setattr(sys, "argv", [argv0, "score"])
    monkeypatch.setattr("shutil.which", lambda name: on_path)
    assert program() == said


def test_deepspeed_s_cpu_notice_is_not_printed():
    """transformers imports deepspeed wherever it is installed, and deepspeed warned "Setting accelerator to CPU"
    on every gradspec train, load or score without a GPU, though nothing asked for deepspeed."""
    pytest.importorskip("deepspeed")
    code = ("from gradspec.cli import main\nmain(['merge', '--out', 'none.parquet'])\n"
            "from deepspeed.accelerator import get_accelerator\nprint(get_accelerator().device_name())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "cpu" and "Setting accelerator" not in done.stderr, done.stderr
