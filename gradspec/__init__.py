"""gradspec: score SFT data by the singular-value spectra of per-sample layer-wise gradients, and align
it with a task by exact gradient cosines."""

import importlib
from importlib.metadata import PackageNotFoundError, version

from gradspec.environment import environment  # eager and light: the name is both a module and a function

try:
    __version__ = version("gradspec")  # the installed distribution's: what score files record
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# Each public name and the module that defines it, imported on first use: `import gradspec` (and the
# command line, whose argument errors should be instant) does not load torch, pandas or transformers.
_EXPORTS = {
    "Fields": "data.readers", "InputError": "data.readers", "BatchScores": "engine.spectral_engine",
    "SpectralEngine": "engine.spectral_engine", "linear_target": "layers",
    "register_layer_kind": "layers", "METRICS": "linalg.metrics", "register_metric": "linalg.metrics",
    "align": "runs.api", "score": "runs.api", "read_metadata": "runs.score_files", "read_scores": "runs.score_files",
    "iter_scores": "runs.score_files",
    "WITCollator": "training.wit", "WITLoss": "training.wit", "use_wit_loss": "training.wit",
    "wit_loss": "training.wit", "with_sample_index": "training.sample_index",
    "keep_sample_index": "training.sample_index", "SFTMixTrainer": "training.sftmix",
    "DynamicsCallback": "training.dynamics",
    "SpectralMonitor": "training.monitor", "SpectralMonitorCallback": "training.monitor_callback",
    "read_monitor": "training.monitor_parts",
}
_NAMES = {"register_layer_kind": "register"}  # exported under another name than its module's

__all__ = ["__version__", "environment", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"gradspec.{_EXPORTS[name]}"), _NAMES.get(name, name))
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'gradspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
