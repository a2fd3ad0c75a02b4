"""Training dynamics of SFT samples, after Dataset Cartography, adapted to generation.

At each epoch or checkpoint, every training sample's response is measured teacher-forced: mean
probability of the target tokens, perplexity, token accuracy. Across checkpoints:

- ``confidence``: mean over checkpoints of the mean target-token probability;
- ``variability``: its standard deviation (population, as in Cartography);
- ``correctness``: share of checkpoints where the sample counts as learned (token accuracy at
  least ``learned_accuracy``, default 0.9: generation has no single label to get right);
- ``forgetting_events``: learned at one checkpoint, not at the next (Toneva et al.);
- ``mean_perplexity``: SFTMix's confidence is its negative.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import TrainerCallback

from .batching import BATCH_TOKENS, Item, item_losses
from .data import Sample
from .output import METADATA_KEY
from .templates import tokenize

LEARNED_ACCURACY = 0.9
MEASURES = ("mean_token_prob", "perplexity", "token_accuracy")


def measure(model: torch.nn.Module, tokenizer, samples: list[Sample], template: str = "plain",
            max_length: int = 2048, batch_tokens: int = BATCH_TOKENS) -> dict[int, dict[str, float]]:
    """Sample index -> MEASURES for the model as it is now (NaN for a sample with nothing to score)."""
    items = [Item(s, tokenize(s.messages, tokenizer, template, max_length)) for s in samples]
    return measure_tokens(model, tokenizer, items, batch_tokens)


def measure_tokens(model: torch.nn.Module, tokenizer, items: list[Item],
                   batch_tokens: int = BATCH_TOKENS) -> dict[int, dict[str, float]]:
    """MEASURES over the labelled tokens of already tokenized items, keyed by sample index."""
    was_training = model.training
    model.eval()
    out = {i.sample.index: dict.fromkeys(MEASURES, math.nan) for i in items}
    scorable = [i for i in items if i.tokens.scorable]
    for item, loss, stats in item_losses(model, tokenizer, scorable, batch_tokens, token_stats=True):
        if math.isfinite(loss):
            out[item.sample.index] = {"mean_token_prob": stats["mean_token_prob"], "perplexity": math.exp(loss),
                                      "token_accuracy": stats["token_accuracy"]}
    model.train(was_training)
    return out


def summarise(checkpoints: dict[str, dict[int, dict[str, float]]],
              learned_accuracy: float = LEARNED_ACCURACY) -> pd.DataFrame:
    """One row per sample index: the per-checkpoint measures (lists, in checkpoint order) and the
    statistics across them."""
    names = list(checkpoints)
    indices = sorted(next(iter(checkpoints.values())))
    rows = []
    for i in indices:
        series = {m: np.array([checkpoints[c][i][m] for c in names]) for m in MEASURES}
        learned = series["token_accuracy"] >= learned_accuracy
        rows.append({
            "index": i, **{m: v.tolist() for m, v in series.items()},
            "confidence": float(series["mean_token_prob"].mean()),
            "variability": float(series["mean_token_prob"].std()),
            "correctness": float(learned.mean()),
            "forgetting_events": int((learned[:-1] & ~learned[1:]).sum()),
            "mean_perplexity": float(series["perplexity"].mean()),
        })
    return pd.DataFrame(rows)


def write_dynamics(table: pd.DataFrame, path: str | Path, checkpoints: list[str], learned_accuracy: float) -> None:
    meta = {"checkpoints": checkpoints, "learned_accuracy": learned_accuracy}
    arrow = pa.Table.from_pandas(table, preserve_index=False)
    arrow = arrow.replace_schema_metadata({**arrow.schema.metadata, METADATA_KEY: json.dumps(meta).encode()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(arrow, path)


def read_dynamics(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """(the table, its checkpoints and threshold)."""
    table = pq.read_table(path)
    return table.to_pandas(), json.loads(table.schema.metadata[METADATA_KEY])


def from_checkpoints(checkpoints: list[str], samples: list[Sample], template: str = "plain",
                     max_length: int = 2048, device: str = "cpu") -> dict[str, dict[int, dict[str, float]]]:
    """The measures of every sample at each saved checkpoint (folders, in training order)."""
    from .models import load_model

    out = {}
    for path in checkpoints:
        model, tokenizer = load_model(path, device)
        out[path] = measure(model, tokenizer, samples, template, max_length)
    return out


class DynamicsCallback(TrainerCallback):
    """Measures every training sample at the end of each epoch; writes the dynamics at the end."""

    def __init__(self, tokenizer, samples: list[Sample], out: str | Path, template: str = "plain",
                 max_length: int = 2048, learned_accuracy: float = LEARNED_ACCURACY) -> None:
        self.tokenizer, self.samples, self.out = tokenizer, samples, out
        self.template, self.max_length, self.learned_accuracy = template, max_length, learned_accuracy
        self.checkpoints: dict[str, dict[int, dict[str, float]]] = {}

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        name = f"epoch {state.epoch:g}"
        self.checkpoints[name] = measure(model, self.tokenizer, self.samples, self.template, self.max_length)

    def on_train_end(self, args, state, control, **kwargs):
        if self.checkpoints:
            write_dynamics(summarise(self.checkpoints, self.learned_accuracy), self.out, list(self.checkpoints),
                           self.learned_accuracy)
