"""The LDS retrains' subsets: M random subsets of the pool, each a fixed share of it. Subset k is drawn
from a generator seeded by (seed, k) alone, so any process (a shard, a torchrun rank, a resume) draws the
same members without the others, and the members are recorded beside each retrain anyway."""

from __future__ import annotations

import numpy as np

LDS_STREAM = 0  # the generator streams of (seed, stream, k): LDS subsets, the outcome's random selections
RANDOM_STREAM = 1
REMOVAL_STREAM = 2  # and the removal test's random removals


def subset_size(pool: int, fraction: float) -> int:
    """Rows of a subset: the fraction of the pool, rounded, at least 1 and at most pool - 1 (a subset that is
    the whole pool or nothing tells nothing apart)."""
    return int(min(max(round(fraction * pool), 1), max(pool - 1, 1)))


def draw(pool: list[int], size: int, seed: int, stream: int, k: int) -> list[int]:
    """size members of pool (its row indices), sorted, from the generator of (seed, stream, k)."""
    rng = np.random.default_rng([seed, stream, k])
    return sorted(int(pool[i]) for i in rng.choice(len(pool), size, replace=False))


def lds_subset(pool: list[int], fraction: float, seed: int, k: int) -> list[int]:
    """Subset k of the LDS retrains: its members' row indices, sorted."""
    return draw(pool, subset_size(len(pool), fraction), seed, LDS_STREAM, k)
