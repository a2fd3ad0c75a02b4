"""The selection outcome: each score's top share of the pool (plain, and shared out over length
buckets as `gradspec select --length-buckets` does), a random share and the longest responses, each
retrained over several seeds; then each selection's held-out target loss against random's of the same
seed, as paired differences with a t interval."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from gradspec.analysis.select import balanced_order
from gradspec.validation.subsets import RANDOM_STREAM, draw, subset_size

RANDOM, LENGTH = "random", "length"


@dataclass(frozen=True)
class Selection:
    """One outcome retrain: which selection (a score's name, random or length), its length buckets (0:
    none), its seed number (0 ... seeds - 1) and its members' row indices."""

    name: str
    buckets: int
    seed: int
    members: list[int]


def top_rows(values: np.ndarray, pool: list[int], num_tokens: dict[int, int], count: int, buckets: int) -> list[int]:
    """The count rows of pool with the highest values (by row index; NaN last, ties in pool order), or with
    buckets > 0 shared out over that many length buckets (analysis.select.balanced_order); sorted."""
    frame = pd.DataFrame({"index": pool, "score": values[pool], "num_tokens": [num_tokens[i] for i in pool]})
    ranked = frame.sort_values("score", ascending=False, kind="stable", na_position="last")
    if buckets > 0:
        ranked = balanced_order(ranked, min(buckets, len(frame)))
    return sorted(int(i) for i in ranked.head(count)["index"])


def plan(scores: dict[str, np.ndarray], pool: list[int], num_tokens: dict[int, int], response_tokens: dict[int, int],
         top: float, seeds: int, buckets: int, seed: int) -> list[Selection]:
    """Every outcome retrain: per seed, random (drawn per seed from (seed, s)), length (the longest responses)
    and each score (values per row index), each score also over length buckets when buckets > 0."""
    count = subset_size(len(pool), top)
    length = np.zeros(max(pool) + 1)
    length[pool] = [response_tokens[i] for i in pool]
    out = []
    for s in range(seeds):
        out.append(Selection(RANDOM, 0, s, draw(pool, count, seed, RANDOM_STREAM, s)))
        out.append(Selection(LENGTH, 0, s, top_rows(length, pool, num_tokens, count, 0)))
        for name, values in scores.items():
            for b in dict.fromkeys([0, buckets]):
                out.append(Selection(name, b, s, top_rows(values, pool, num_tokens, count, b)))
    return out


def t_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """The t interval of the mean of paired differences over seeds (the outcome's gains, the removal test's
    effects); NaN where there is none (fewer than 2 seeds, or a difference that is not finite)."""
    if len(values) < 2 or not np.isfinite(values).all():
        return np.nan, np.nan
    sem = stats.sem(values)
    if sem == 0:
        return float(values.mean()), float(values.mean())
    low, high = stats.t.interval(confidence, len(values) - 1, loc=values.mean(), scale=sem)
    return float(low), float(high)


def interval_text(low: float, high: float, seeds: int) -> str:
    """A t interval over seeds as the summary prints it, or why there is none (one seed, a NaN loss) rather
    than NaNs."""
    if np.isfinite(low):
        return f"[{low:+.4f}, {high:+.4f}] over {seeds} seeds"
    if seeds < 2:
        return f"(no interval: {seeds} seed; --seeds 2 or more give one)"
    return f"(no interval over {seeds} seeds: a retrain measured no finite loss)"


def mean_losses(rows: pd.DataFrame) -> pd.DataFrame:
    """rows with loss: each retrain's mean target loss (NaN targets left out)."""
    return rows.assign(loss=[np.nanmean(v) if len(v) else np.nan for v in rows["target_loss"]])


def paired_effects(rows: pd.DataFrame, keys: list[str], baseline: pd.Series, sign: Callable[[tuple], float],
                   confidence: float) -> pd.DataFrame:
    """Per group of rows by keys: its seeds, mean target loss, and its effect, sign(key) x (its loss - the
    baseline rows' loss of the same seed), with a t interval over seeds (low, high); where the retrains
    measured a metric, its mean and its effect, -sign(key) x (its metric - the baseline's) (a metric is
    higher-is-better). The one paired comparison of the outcome, the removal test and the objectives."""
    rows = mean_losses(rows)
    base = rows[baseline].set_index("seed")
    out = []
    for key, group in rows.groupby(keys, sort=False):
        group = group.set_index("seed")
        seeds = group.index.intersection(base.index)
        effect = sign(key) * (group.loc[seeds, "loss"] - base.loc[seeds, "loss"]).to_numpy(dtype=float) + 0.0
        low, high = t_interval(effect, confidence)
        row = {**dict(zip(keys, key, strict=True)), "seeds": len(group), "loss": group["loss"].mean(),
               "effect": effect.mean() if len(effect) else np.nan, "low": low, "high": high}
        if "metric" in rows and group["metric"].notna().any():
            metric = -sign(key) * (group.loc[seeds, "metric"] - base.loc[seeds, "metric"]).to_numpy(dtype=float)
            row.update(metric=group["metric"].mean(), metric_effect=metric.mean())
        out.append(row)
    return pd.DataFrame(out)


def outcome_table(rows: pd.DataFrame, confidence: float = 0.95, baseline: str = RANDOM) -> pd.DataFrame:
    """Per selection (and buckets): the seeds, the mean target loss, and its gain over random of the same
    seed (random's loss - its own: positive = better than random) with a t interval over seeds; the
    metric's gain too where the retrains measured one (its own - random's: higher is better). baseline:
    the selection the others are compared with (the objectives': ntp)."""
    table = paired_effects(rows, ["selection", "buckets"], rows["selection"] == baseline, lambda _: -1.0, confidence)
    table = table.rename(columns={"effect": "gain", "low": "gain_low", "high": "gain_high",
                                  "metric_effect": "metric_gain"})
    return table.astype({"buckets": int}) if len(table) else table
