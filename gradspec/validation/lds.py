"""The linear datamodeling score (LDS: Ilyas et al. 2022, as TRAK and bergson's validate compute it): a
score predicts that training on subset S changes target j's loss by the sum of its values a_ij over the
rows i of S; the LDS of target j is the Spearman correlation, across subsets, between that prediction
and the negative measured loss (positive: the score says which subsets help, and they do); the LDS is
the mean over targets, with a bootstrap interval over subsets.

The LDS beyond length (partial_lds) asks what a score predicts that length does not: the same Spearman
correlation with the prediction that length alone makes (the subset's total response tokens) held
fixed, as a partial correlation of the ranks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

RESPONSE_TOKENS = "response_tokens"  # a retrain file's metadata: each row's response tokens (None: not in the pool)


@dataclass(frozen=True)
class LDS:
    """value: the mean over targets; low, high: its bootstrap interval; per_target: each target's (NaN
    where it cannot be computed: a constant prediction or loss, or one that is length's own); subsets: how
    many."""

    value: float
    low: float
    high: float
    per_target: np.ndarray
    subsets: int


def predictions(members: list[list[int]], attribution: np.ndarray) -> np.ndarray:
    """(subsets, targets): for each subset the sum of its rows' attributions (rows x targets, by row
    index); NaN counts as 0 (a row left unscored adds nothing)."""
    a = np.nan_to_num(np.asarray(attribution, dtype=float), nan=0.0)
    return np.stack([a[np.asarray(m, dtype=int)].sum(0) for m in members])


def spearman_columns(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman correlation of each column of x with the same column of y, over the rows (axis -2), for
    stacked arrays too: Pearson's of the ranks (ties averaged); NaN where a column is constant."""
    rx, ry = rankdata(x, axis=-2), rankdata(y, axis=-2)
    rx, ry = rx - rx.mean(-2, keepdims=True), ry - ry.mean(-2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (rx * ry).sum(-2) / np.sqrt((rx * rx).sum(-2) * (ry * ry).sum(-2))


def partial_spearman_columns(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The Spearman correlation of each column of x with the same column of y with z held fixed (z: one
    column, or one per column of x), over the rows (axis -2), stacked arrays too: the partial correlation
    of the ranks, (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2)). NaN where a column is constant or
    x or y is a monotone function of z (nothing is left of it once z is held fixed)."""
    r_xy, r_xz, r_yz = spearman_columns(x, y), spearman_columns(x, z), spearman_columns(y, z)
    with np.errstate(invalid="ignore", divide="ignore"):
        left = (1 - r_xz ** 2) * (1 - r_yz ** 2)
        out = (r_xy - r_xz * r_yz) / np.sqrt(left)
    return np.where(left > _LEFT, out, np.nan)


_LEFT = 1e-9  # below it, x or y is z's ranks (up to rounding): no partial correlation to compute


def _mean(per_target: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # every target NaN: the mean is NaN, said by the caller
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(per_target, axis=-1)


def lds(predicted: np.ndarray, losses: np.ndarray, resamples: int = 1000, confidence: float = 0.95,
        seed: int = 0, control: np.ndarray | None = None) -> LDS:
    """The LDS of predictions (subsets x targets) against measured losses (subsets x targets), with a
    percentile bootstrap interval from resampling the subsets (seeded). With control (one value per
    subset: length's prediction), the LDS beyond it: each target's partial Spearman correlation."""
    predicted, losses = np.asarray(predicted, dtype=float), np.asarray(losses, dtype=float)
    z = None if control is None else np.asarray(control, dtype=float).reshape(len(predicted), 1)

    def correlate(rows) -> np.ndarray:  # the subsets' rows (all, or a resample's)
        x, y = predicted[rows], -losses[rows]
        return spearman_columns(x, y) if z is None else partial_spearman_columns(x, y, z[rows])

    per_target = correlate(slice(None))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(predicted), size=(resamples, len(predicted)))
    boot = _mean(correlate(picks))
    boot = boot[np.isfinite(boot)]
    tail = (1 - confidence) / 2
    low, high = (np.quantile(boot, [tail, 1 - tail]) if len(boot) else (np.nan, np.nan))
    return LDS(float(_mean(per_target)), float(low), float(high), per_target, len(predicted))


def partial_lds(predicted: np.ndarray, losses: np.ndarray, length: np.ndarray, resamples: int = 1000,
                confidence: float = 0.95, seed: int = 0) -> LDS:
    """The LDS beyond length: lds with length's own prediction (each subset's total response tokens)
    held fixed. Same resamples as lds for the same seed, so the two intervals come from the same draws."""
    return lds(predicted, losses, resamples, confidence, seed, control=length)
