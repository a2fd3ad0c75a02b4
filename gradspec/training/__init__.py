"""Training recipes and tools: WIT (weighted instruction tuning), sample indices for the monitor's rows,
SFTMix, training dynamics, and `gradspec train`. The live spectral monitor is in the core API
(gradspec.SpectralMonitor, gradspec.SpectralMonitorCallback, gradspec.read_monitor).

The names below load on first use: `import gradspec.training` loads neither torch nor transformers.
"""

from gradspec.exports import lazy_names

_EXPORTS = {
    "WITCollator": "gradspec.training.wit", "WITLoss": "gradspec.training.wit",
    "use_wit_loss": "gradspec.training.wit", "wit_loss": "gradspec.training.wit",
    "with_sample_index": "gradspec.training.sample_index", "keep_sample_index": "gradspec.training.sample_index",
    "SFTMixTrainer": "gradspec.training.sftmix", "DynamicsCallback": "gradspec.training.dynamics",
    "load_model": "gradspec.data.models",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
