"""gradspec: score SFT data by the singular-value spectra of per-sample layer-wise gradients, and align
it with a task by exact gradient cosines.

The public API is the names below (``gradspec.__all__``): scoring and reading scores, the engine and
the live monitor, the registration points for a layer kind or a metric, the input fields and the
errors a caller catches. The training recipes (WIT, sample indices, SFTMix, dynamics) are in
``gradspec.training``.
"""

from importlib.metadata import PackageNotFoundError, version

from gradspec import environment  # noqa: F401  (light; the module, callable for one release: see its end)
from gradspec.exports import lazy_names

try:
    __version__ = version("gradspec")  # the installed distribution's: what score files record
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# Each public name and the module that defines it ("module:attribute" where the names differ), imported
# on first use: `import gradspec` (and the command line, whose argument errors should be instant) does
# not load torch, pandas or transformers.
_EXPORTS = {
    "score": "gradspec.runs.api", "align": "gradspec.runs.api",
    "read_scores": "gradspec.runs.score_files", "iter_scores": "gradspec.runs.score_files",
    "read_metadata": "gradspec.runs.score_files", "read_monitor": "gradspec.training.monitor_parts",
    "sum_over_checkpoints": "gradspec.runs.checkpoint_sum",
    "SpectralEngine": "gradspec.engine.spectral_engine", "BatchScores": "gradspec.engine.spectral_engine",
    "SpectralMonitor": "gradspec.training.monitor", "SpectralMonitorCallback": "gradspec.training.monitor_callback",
    "register_layer_kind": "gradspec.layers:register", "linear_target": "gradspec.layers",
    "Target": "gradspec.layers", "Part": "gradspec.layers", "register_metric": "gradspec.linalg.metrics",
    "Fields": "gradspec.data.row_layouts",
    "InputError": "gradspec.errors", "OptionError": "gradspec.options", "RunLocked": "gradspec.files.locks",
}

# Names that moved, kept for one release: where each still resolves, and what to use instead.
_TRAINING = ("WITCollator", "WITLoss", "use_wit_loss", "wit_loss", "with_sample_index", "keep_sample_index",
             "SFTMixTrainer", "DynamicsCallback")
_MOVED = {
    **{name: (f"gradspec.training:{name}", f"use gradspec.training.{name}") for name in _TRAINING},
    "METRICS": ("gradspec.linalg.metrics:METRICS", "an engine's metric columns, in order, are "
                "SpectralEngine(...).metric_names; a score file's are read_metadata(path)['metrics']"),
}

__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, _MOVED)
