"""The objectives test: does a training recipe of `gradspec train` (WIT, SFTMix) beat plain next-token
training (NTP) on the target? Per seed, the whole pool is retrained once with NTP (the retrains' own loss)
and once with each objective, from the same start, with the same steps, learning rate and data-order
seed; each objective's gain is NTP's target loss minus its own for the same seed, with a t interval over
the seeds. The plan and the table are here; the losses the retrains train with are objective_losses'."""

from __future__ import annotations

import pandas as pd

from gradspec.validation.config import NTP, ValidateConfig
from gradspec.validation.outcome import outcome_table

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
