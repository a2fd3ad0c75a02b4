"""Training dynamics of SFT samples, after Dataset Cartography, adapted to generation.

At each epoch or checkpoint, every training sample's response is measured teacher-forced: mean
probability of the target tokens, perplexity, token accuracy. Across checkpoints:

- ``confidence``: mean over checkpoints of the mean target-token probability;
- ``variability``: its standard deviation (population, as in Cartography);
- ``correctness``: share of checkpoints where the sample counts as learned (token accuracy at
  least ``learned_accuracy``, default 0.9: generation has no single label to get right);
- ``forgetting_events``: learned at one checkpoint, not at the next (Toneva et al.);
- ``mean_perplexity``: SFTMix's confidence is its negative.

``status`` is the tokenizer's (see gradspec.data.templates): a row with no response token to measure
keeps its status and gets no statistics (NaN; no forgetting events), never a verdict.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gradspec.choices import MAX_LENGTH
from gradspec.data.batching import BATCH_TOKENS, Item
from gradspec.data.errors import InputError
from gradspec.data.readers import Sample, read_json
from gradspec.data.templates import check_response_tokens, tokenize
from gradspec.engine.loss import item_losses
from gradspec.files import atomic_write
from gradspec.runs.score_files import parquet_schema, schema_metadata, write_parquet

log = logging.getLogger("gradspec")

LEARNED_ACCURACY = 0.9
SAVED = "gradspec_dynamics.json"  # the epochs measured so far, in each Trainer checkpoint (a resume takes them back)
MEASURES = ("mean_token_prob", "perplexity", "token_accuracy")


def measure(model: torch.nn.Module, tokenizer, samples: list[Sample], template: str = "plain",
            max_length: int = MAX_LENGTH, batch_tokens: int = BATCH_TOKENS) -> dict[int, dict[str, Any]]:
    """Sample index -> MEASURES and the tokenizer's status for the model as it is now (NaN for a
    sample with nothing to score)."""
    return measure_tokens(model, tokenizer, _tokenized(samples, tokenizer, template, max_length), batch_tokens)


def _tokenized(samples: list[Sample], tokenizer, template: str = "plain", max_length: int = MAX_LENGTH) -> list[Item]:
    """The samples with their tokens."""
    return [Item(s, tokenize(s.messages, tokenizer, template, max_length)) for s in samples]


def measure_tokens(model: torch.nn.Module, tokenizer, items: list[Item],
                   batch_tokens: int = BATCH_TOKENS) -> dict[int, dict[str, Any]]:
    """MEASURES over the labelled tokens of already tokenized items, and their status, keyed by sample index."""
    was_training = model.training
    model.eval()
    out = {i.sample.index: {**dict.fromkeys(MEASURES, math.nan), "status": i.tokens.status} for i in items}
    scorable = [i for i in items if i.tokens.scorable]
    for item, loss, stats in item_losses(model, tokenizer, scorable, batch_tokens, token_stats=True):
        if math.isfinite(loss):
            out[item.sample.index].update({"mean_token_prob": stats["mean_token_prob"], "perplexity": math.exp(loss),
                                           "token_accuracy": stats["token_accuracy"]})
        else:
            out[item.sample.index]["status"] = "nonfinite_loss"
    model.train(was_training)
    return out


def summarise(checkpoints: dict[str, dict[int, dict[str, Any]]],
              learned_accuracy: float = LEARNED_ACCURACY) -> pd.DataFrame:
    """One row per sample index: its status, the per-checkpoint measures (lists, in checkpoint
    order) and the statistics across them (NaN for a sample never measured)."""
    names = list(checkpoints)
    indices = sorted(next(iter(checkpoints.values())))
    rows = []
    for i in indices:
        series = {m: np.array([checkpoints[c][i][m] for c in names]) for m in MEASURES}
        learned = series["token_accuracy"] >= learned_accuracy
        measured = bool(np.isfinite(series["token_accuracy"]).any())
        rows.append({
            "index": i, "status": _status([checkpoints[c][i].get("status", "ok") for c in names]),
            **{m: v.tolist() for m, v in series.items()},
            "confidence": float(series["mean_token_prob"].mean()),
            "variability": float(series["mean_token_prob"].std()),
            "correctness": float(learned.mean()) if measured else math.nan,
            "forgetting_events": int((learned[:-1] & ~learned[1:]).sum()),
            "mean_perplexity": float(series["perplexity"].mean()),
        })
    return pd.DataFrame(rows)


def _status(statuses: list[str]) -> str:
    """A sample's status over checkpoints: its flags, "ok" when it has none."""
    return ";".join(sorted(set(statuses) - {"ok"})) or "ok"


def write_dynamics(table: pd.DataFrame, path: str | Path, checkpoints: list[str], learned_accuracy: float) -> None:
    meta = {"checkpoints": checkpoints, "learned_accuracy": learned_accuracy}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_parquet(table, path, meta)


def read_dynamics(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """(the table, its checkpoints and threshold)."""
    what = "pass a dynamics file (from gradspec dynamics or gradspec train)"
    meta = schema_metadata(parquet_schema(path, what))
    if "checkpoints" not in meta:
        raise InputError(f"{path}: not a dynamics file; {what}")
    return pq.read_table(path).to_pandas(), meta


def from_checkpoints(checkpoints: list[str], samples: list[Sample], template: str = "plain",
                     max_length: int = MAX_LENGTH, device: str = "cpu") -> dict[str, dict[int, dict[str, Any]]]:
    """The measures of every sample at each saved checkpoint (folders, in training order), each cut to
    max_length tokens or to the checkpoint's context where that is shorter (models.fit_to_context)."""
    from gradspec.data.models import fit_to_context, load_model

    out = {}
    for path in checkpoints:
        model, tokenizer = load_model(path, device)
        max_length = fit_to_context(max_length, model)  # kept for the next checkpoints: said once
        items = _tokenized(samples, tokenizer, template, max_length)
        check_response_tokens(Counter(item.tokens.status for item in items))
        out[path] = measure_tokens(model, tokenizer, items)
    return out


def read_kept(path: str | Path, indices: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
    """The epochs measured before a checkpoint, as on_save kept them there (SAVED): each epoch's
    MEASURES and status of exactly these samples (the run's, by index). InputError naming path and the
    entry where it holds anything else (another run's data, a damaged file)."""
    kept = read_json(path)
    if not isinstance(kept, dict):
        raise InputError(f"{path}: an object of measured epochs expected, got {type(kept).__name__}")
    out = {}
    for name, measured in kept.items():
        rows = {int(i): m for i, m in measured.items() if i.isdecimal()} if isinstance(measured, dict) else {}
        if not isinstance(measured, dict) or len(rows) != len(measured) or sorted(rows) != sorted(indices):
            raise InputError(f"{path}: {name!r}: measures of {len(rows) if isinstance(measured, dict) else 'no'} "
                             f"samples, not of this run's {len(indices)} (by index): resume with the data the run "
                             "was started with")
        for i, m in rows.items():
            if not (isinstance(m, dict) and isinstance(m.get("status", ""), str)
                    and all(isinstance(m.get(k), int | float) and not isinstance(m.get(k), bool) for k in MEASURES)):
                raise InputError(f"{path}: {name!r}: sample {i}: {', '.join(MEASURES)} (numbers) and a status "
                                 "expected")
        out[name] = rows
    return out


def _checkpoint(args, state) -> Path:
    """The folder Trainer saves (or has saved) the checkpoint of state's step in."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def _processes(model: torch.nn.Module) -> tuple[int, int]:
    """(rank, world size) among which to split the samples: under torch.distributed each process
    measures its share; (0, 1) alone, or where the model is sharded (FSDP: every forward is collective,
    so every process measures every sample, in step)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, 1
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if any(isinstance(m, FSDPModule | FullyShardedDataParallel) for m in model.modules()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class DynamicsCallback(TrainerCallback):
    """Measures every training sample at the end of each epoch; writes the dynamics at the end. Under
    torchrun each process measures its share of the samples (the measures gathered on every process)
    and the first process alone writes ``out`` and each checkpoint's record.

    Args:
        tokenizer: The model's tokenizer.
        samples: The training samples, measured teacher-forced in forward passes alone.
        out: The dynamics file (Parquet), written at the end of training.
        template: "plain" or "chat", as the training tokenizes.
        max_length: Tokens kept per sample (truncated on the right).
        learned_accuracy: The token accuracy from which a sample counts as learned at a checkpoint
            (correctness, forgetting_events).
    """

    def __init__(self, tokenizer, samples: list[Sample], out: str | Path, template: str = "plain",
                 max_length: int = MAX_LENGTH, learned_accuracy: float = LEARNED_ACCURACY) -> None:
        self.tokenizer, self.samples, self.out = tokenizer, samples, out
        self.template, self.max_length, self.learned_accuracy = template, max_length, learned_accuracy
        self.checkpoints: dict[str, dict[int, dict[str, Any]]] = {}
        self.write_error: OSError | None = None  # why out could not be written at the end (the run goes on)

    def on_train_begin(self, args, state, control, **kwargs):
        """A run resumed from a checkpoint (global_step > 0) takes back the epochs measured before it, which
        on_save kept in that checkpoint's folder.

        Args:
            args: Trainer's TrainingArguments: its output_dir holds the checkpoints.
            state: Trainer's TrainerState: a resumed run's global_step is its checkpoint's.
            control: Trainer's TrainerControl (unused).
        """
        self.checkpoints = {}
        if state.global_step:
            kept = _checkpoint(args, state) / SAVED
            if kept.exists():
                self.checkpoints = read_kept(kept, [s.index for s in self.samples])
            else:
                log.warning("%s: not there; the dynamics cover the epochs from step %d on", kept, state.global_step)

    def on_save(self, args, state, control, model=None, **kwargs):
        """Keeps the epochs measured so far in the checkpoint Trainer has just saved, for a resume: an
        epoch's last step is saved before its on_epoch_end, so that epoch is measured here, first.

        Args:
            args: Trainer's TrainingArguments: its output_dir holds the checkpoints.
            state: Trainer's TrainerState: global_step names the checkpoint, epoch says whether one ends.
            control: Trainer's TrainerControl (unused).
            model: The model being trained.
        """
        if state.epoch and state.epoch == round(state.epoch):
            self._measure(state.epoch, model)
        if _checkpoint(args, state).is_dir() and state.is_world_process_zero:
            atomic_write(_checkpoint(args, state) / SAVED, lambda f: f.write(json.dumps(self.checkpoints).encode()))

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        """Measures every sample under the model as it is now, as checkpoint "epoch <n>" (where on_save
        has not).

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState: its epoch names the checkpoint.
            control: Trainer's TrainerControl (unused).
            model: The model being trained.
        """
        self._measure(state.epoch, model)

    def _measure(self, epoch: float, model) -> None:
        name = f"epoch {epoch:g}"
        if name in self.checkpoints:
            return
        rank, processes = _processes(model)
        measured = measure(model, self.tokenizer, self.samples[rank::processes], self.template, self.max_length)
        if processes > 1:
            import torch.distributed as dist

            shares: list[dict] = [{}] * processes
            dist.all_gather_object(shares, measured)
            measured = {i: share[i] for share in shares for i in share}
        self.checkpoints[name] = {s.index: measured[s.index] for s in self.samples}  # in the samples' order

    def on_train_end(self, args, state, control, **kwargs):
        """Writes the per-sample statistics across the measured epochs to ``out``.

        Args:
            args: Trainer's TrainingArguments (unused).
            state: Trainer's TrainerState (unused).
            control: Trainer's TrainerControl (unused).
        """
        if not self.checkpoints or not state.is_world_process_zero:
            return
        try:
            write_dynamics(summarise(self.checkpoints, self.learned_accuracy), self.out, list(self.checkpoints),
                           self.learned_accuracy)
        except OSError as e:  # a full disk: the training it measured must not be lost with it (write_error)
            self.write_error = e
            log.error("%s not written: %s; the training goes on", self.out, e)
