"""The objectives test: does a training recipe of `gradspec train` (WIT, SFTMix) beat plain next-token
training (NTP) on the target? Per seed, the whole pool is retrained once with NTP (the retrains' own loss)
and once with each objective, from the same start, with the same steps, learning rate and data-order
seed; each objective's gain is NTP's target loss minus its own for the same seed, with a t interval over
the seeds. The plan and the table are here; the losses the retrains train with are objective_losses'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from gradspec.validation.config import NTP, ValidateConfig
from gradspec.validation.outcome import interval_text, outcome_table

OBJECTIVE = "objective"  # the retrains' kind


def plan(config: ValidateConfig) -> list[tuple[str, int]]:
    """(objective, seed number) of every objectives retrain, in plan order: per seed number s (0 ...
    seeds - 1), NTP, then each of --objectives. None without --objectives."""
    if not config.objectives:
        return []
    return [(name, s) for s in range(config.seeds) for name in (NTP, *config.objectives)]


def count(config: ValidateConfig) -> int:
    """How many objectives retrains plan makes."""
    return config.seeds * (1 + len(config.objectives)) if config.objectives else 0


def objective_table(rows: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per objective (NTP first): the seeds, the mean target loss, and its gain over NTP of the same seed
    (NTP's loss - its own: positive = better than NTP) with a t interval over the seeds; the metric and
    its gain (its own - NTP's) where the retrains measured one. rows: the retrain file's objective rows."""
    table = outcome_table(rows, confidence, baseline=NTP).drop(columns="buckets")
    return table.rename(columns={"selection": "objective"})


def objectives_summary(table: pd.DataFrame, confidence: float) -> list[str]:
    """The objectives test for the terminal."""
    lines = ["Objectives, each on the whole pool (mean target loss; gain = NTP's loss - its own, same seed, "
             f"{confidence:.0%} t interval over seeds):"]
    for r in table.itertuples():
        metric = "" if pd.isna(getattr(r, "metric_gain", np.nan)) or r.objective == NTP else \
            f"; metric gain {r.metric_gain:+.4f}"
        lines.append(f"  {r.objective}: loss {r.loss:.4f}" + ("" if r.objective == NTP else
                     f", gain {r.gain:+.4f} {interval_text(r.gain_low, r.gain_high, r.seeds)}{metric}"))
    return lines


def objectives_report(table: pd.DataFrame, out: Path, confidence: float, info: dict) -> list[str]:
    """The objectives test's section of report.md; writes objectives.csv into out."""
    table.to_csv(out / "objectives.csv", index=False)
    return ["## Objectives", "", "The whole pool retrained with plain next-token training (ntp: the retrains' "
            "own loss) and with each objective (gradspec train's losses: WIT with prompt weight "
            f"{info.get('prompt_weight')} and response weight {info.get('response_weight')}; SFTMix with its "
            "alpha and mu, its confidence from the start model's perplexity, each sample's loss a mean over "
            "its own tokens as NTP's), from the same start with the same steps and seeds; gain = "
            "NTP's mean target loss minus the objective's for the same seed (positive: better than NTP), with "
            f"a {confidence:.0%} t interval over seeds; metric_gain: its metric minus NTP's.", "",
            table.to_markdown(index=False, floatfmt=".4f"), ""]
