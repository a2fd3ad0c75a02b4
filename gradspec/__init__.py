"""gradspec: score SFT data by the singular-value spectra of per-sample layer-wise gradients, and align
it with a task by exact gradient cosines."""

import importlib
from importlib.metadata import PackageNotFoundError, version

from gradspec.data.readers import Fields, InputError
from gradspec.engine.spectral_engine import BatchScores, SpectralEngine
from gradspec.environment import environment
from gradspec.layers import linear_target
from gradspec.layers import register as register_layer_kind
from gradspec.linalg.metrics import METRICS, register_metric
from gradspec.runs.api import align, score
from gradspec.runs.score_files import read_metadata, read_scores

try:
    __version__ = version("gradspec")  # the installed distribution's: what score files record
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The training classes import transformers' Trainer: loaded on first use, not with every `import gradspec`.
_TRAINING = {
    "WITCollator": "wit", "WITLoss": "wit", "use_wit_loss": "wit", "wit_loss": "wit",
    "SFTMixTrainer": "sftmix", "DynamicsCallback": "dynamics", "SpectralMonitor": "monitor",
    "SpectralMonitorCallback": "monitor_callback",
}

__all__ = ["METRICS", "__version__", "BatchScores", "Fields", "InputError", "SpectralEngine", "align", "environment",
           "linear_target", "read_metadata", "read_scores", "register_layer_kind", "register_metric", "score",
           *_TRAINING]


def __getattr__(name: str):
    if name in _TRAINING:
        return getattr(importlib.import_module(f"gradspec.training.{_TRAINING[name]}"), name)
    raise AttributeError(f"module 'gradspec' has no attribute {name!r}")
