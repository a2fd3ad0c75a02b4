"""The removal test (bergson's leaderboard; DATE-LM's for harmful rows): retrain on the pool less the rows a
score ranks highest, and on the pool less those it ranks lowest, beside the pool less a random share of the
same size, each over several seeds. A score that finds the rows that help the target raises the target loss
more by removing its top than random removal does; one that finds the rows that hurt it lowers the loss (or
raises it less) by removing its bottom. Each end's effect is its paired difference against random removal
of the same seed, signed so that positive means the score is right, with a t interval over seeds."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradspec.validation.outcome import RANDOM, interval_text, paired_effects
from gradspec.validation.subsets import REMOVAL_STREAM, draw, subset_size

log = logging.getLogger("gradspec")
REMOVAL = "removal"  # the retrains' kind
TOP, BOTTOM = "top", "bottom"  # which end of a score was removed (random: a random share)
SIGN = ("positive = the score is right: for top, the loss without its top rows minus the loss without random "
        "rows (removing the rows it says help hurts more than random removal); for bottom, the loss without "
        "random rows minus the loss without its bottom rows (removing the rows it says hurt, or help least, "
        "hurts less than random removal)")


@dataclass(frozen=True)
class Removal:
    """One removal retrain: the score's name (or random), the end removed (top, bottom or random), its
    seed number (0 ... seeds - 1) and the rows it keeps (the pool less the removed rows), sorted."""

    name: str
    removed: str
    seed: int
    kept: list[int]


def removal_count(specs: tuple[str, ...], seeds: int) -> int:
    """The removal test's retrains: per seed, random removal and each score's top and bottom."""
    return seeds * (1 + 2 * len(specs)) if specs else 0


def ends(values: np.ndarray, pool: list[int], count: int) -> tuple[list[int], list[int]]:
    """The count rows of pool with the highest values (by row index) and the count with the lowest, each
    sorted. Ties rank in pool order (the top takes the earlier rows, the bottom the later ones), so both
    ends are disjoint whenever 2 * count rows have a value; a row without one (NaN) is taken by either
    end only after every row with one."""
    rows = np.asarray(pool, dtype=int)
    scored = np.isfinite(values[rows])
    ranked = rows[scored][np.argsort(-values[rows][scored], kind="stable")]  # highest first
    unscored = rows[~scored]
    top = np.concatenate([ranked, unscored])[:count]
    bottom = np.concatenate([ranked[::-1], unscored])[:count]
    return sorted(int(i) for i in top), sorted(int(i) for i in bottom)


def plan(scores: dict[str, np.ndarray], pool: list[int], share: float, seeds: int, seed: int) -> list[Removal]:
    """Every removal retrain, per seed: random removal (drawn per seed from (seed, REMOVAL_STREAM, s)), then
    each score's (values per row index) top and bottom share of the pool removed."""
    count = subset_size(len(pool), share)
    cut = {name: ends(values, pool, count) for name, values in scores.items()}
    for name, (top, bottom) in cut.items():
        if shared := len(set(top) & set(bottom)):
            log.warning("%s: its top and bottom %d rows share %d (fewer than twice as many rows of the pool have a "
                        "value); a smaller --remove keeps them apart", name, count, shared)
    out = []
    for s in range(seeds):
        out.append(Removal(RANDOM, RANDOM, s, _kept(pool, draw(pool, count, seed, REMOVAL_STREAM, s))))
        for name, (top, bottom) in cut.items():
            out += [Removal(name, TOP, s, _kept(pool, top)), Removal(name, BOTTOM, s, _kept(pool, bottom))]
    return out


def _kept(pool: list[int], removed: list[int]) -> list[int]:
    gone = set(removed)
    return sorted(int(i) for i in pool if i not in gone)


def removal_table(rows: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per score and end removed: the seeds, the mean target loss, and the effect against random removal of
    the same seed (SIGN: positive = the score is right) with a t interval over seeds; the metric's effect
    too where the retrains measured one (signed alike: higher is better, so for top random's metric minus
    its own, for bottom its own minus random's). Random removal's own row has effect 0."""
    table = paired_effects(rows, ["selection", "removed"], rows["removed"] == RANDOM,
                           lambda key: 1.0 if key[1] == TOP else -1.0, confidence)  # without the top the loss rises
    return table.rename(columns={"selection": "score", "low": "effect_low", "high": "effect_high"})


def summary_lines(table: pd.DataFrame, confidence: float) -> list[str]:
    """The removal test for the terminal."""
    lines = ["Removal test (mean target loss after retraining on the pool less a share of it; effect against random "
             f"removal of the same seed, {confidence:.0%} t interval over seeds; positive = the score is right):",
             "  (effect of top = loss without its top - loss without random rows; of bottom = loss without random "
             "rows - loss without its bottom)"]
    for r in table.itertuples():
        label = "random rows removed" if r.removed == RANDOM else f"{r.score}, its {r.removed} removed"
        lines.append(f"  {label}: loss {r.loss:.4f}" + ("" if r.removed == RANDOM else
                     f", effect {r.effect:+.4f} {interval_text(r.effect_low, r.effect_high, r.seeds)}"))
    return lines


def report_lines(table: pd.DataFrame, out: Path, confidence: float) -> list[str]:
    """The removal test's section of report.md; writes removal.csv and removal.png into out."""
    table.to_csv(out / "removal.csv", index=False)
    _plot(table, out / "removal.png")
    lines = ["## Removal test", "", "Each retrain trains on the pool less a share of it (`--remove`): a score's top "
             "rows, its bottom rows, or random rows. Loss: the mean target loss after it; effect: the paired "
             f"difference against random removal of the same seed, with a {confidence:.0%} t interval over seeds, "
             f"signed so that {SIGN}. An interval above 0 for top: the score finds rows that help the target; for "
             "bottom: it finds rows that help it least or hurt it.", "", "![removal](removal.png)", "",
             table.to_markdown(index=False, floatfmt=".4f"), ""]
    if table.loc[table["removed"] != RANDOM, "effect_low"].isna().any():
        lines += ["effect_low and effect_high are NaN where there is no interval: a removal retrained with one seed "
                  "(--seeds 2 or more give one), or a retrain that measured no finite loss.", ""]
    return lines


def _plot(table: pd.DataFrame, path: Path) -> None:
    """Each score's effect for its top and its bottom side by side, with their intervals."""
    shown = table[table["removed"] != RANDOM]
    names = list(dict.fromkeys(shown["score"]))
    fig = Figure(figsize=(1.5 + 1.4 * len(names), 3.4))
    ax = fig.subplots()
    for k, end in enumerate((TOP, BOTTOM)):
        part = shown[shown["removed"] == end].set_index("score").reindex(names)
        below = np.nan_to_num(np.clip(part["effect"] - part["effect_low"], 0, None))
        above = np.nan_to_num(np.clip(part["effect_high"] - part["effect"], 0, None))
        ax.bar(np.arange(len(names)) + (k - 0.5) * 0.38, part["effect"], width=0.38, yerr=[below, above], capsize=3,
               label=f"{end} removed")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("effect vs random removal\n(positive: the score is right)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
