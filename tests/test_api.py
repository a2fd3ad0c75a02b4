"""The public API stays importable from gradspec as the README documents it."""

import subprocess
import sys

import gradspec


def test_every_public_name_is_importable_from_gradspec():
    for name in gradspec.__all__:
        assert getattr(gradspec, name) is not None, name
    from gradspec import SpectralMonitor, SpectralMonitorCallback, WITCollator  # noqa: F401  (the README's imports)


def test_import_gradspec_does_not_load_the_trainer():
    """The training classes load transformers' Trainer on first use only (the CLI starts faster)."""
    code = "import sys, gradspec; print('transformers.trainer' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_version_is_the_one_score_files_record():
    from importlib.metadata import version

    import gradspec

    assert gradspec.__version__ == version("gradspec") and "__version__" in gradspec.__all__
