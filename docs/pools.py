"""The pools the docs' experiments retrain on, built from the shared data: one copy of what they share."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gradspec.data.readers import Fields, read_samples

DATA = Path(__file__).resolve().parents[2] / "shared/data/gradient_unified"


def instruction_samples(per_file: int) -> list:
    """The first per_file rows of each published high and low subset (reward, IFD, difficulty) of WizardLM,
    OpenHermes and Magpie, shuffled with seed 0: instruction data of every quality."""
    samples = []
    for metric in ("reward", "ifd_gpt2", "diff"):
        for source in ("wiz", "her", "mag"):
            for side in ("highest", "lowest"):
                samples += list(read_samples(DATA / f"{metric}/{source}_10k_{side}_200.json", Fields()))[:per_file]
    random.Random(0).shuffle(samples)
    return samples


def gsm8k_samples() -> list:
    """The gsm8k DeepSeek-R1 reasoning traces, in file order."""
    return list(read_samples(DATA / "reasoning/gsm8k_R1.json", Fields()))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
