"""gradspec: score SFT data by the singular-value spectra of per-sample layer-wise gradients."""

from .data import Fields, InputError
from .engine import BatchScores, SpectralEngine
from .metrics import METRICS
from .output import read_metadata, read_scores
from .scoring import score

__all__ = ["METRICS", "BatchScores", "Fields", "InputError", "SpectralEngine", "read_metadata", "read_scores",
           "score"]
