"""What the peers' drivers (kronfluence_scores.py, dattri_scores.py) share: the pool and target rows read as
gradspec reads them, a (target, pool) score table written as the attribution file `gradspec validate
--scores` reads, and the JSON sidecar beside it with the tool, its version, wall time and peak memory.

Pure Python over gradspec's own reader and template (no compiled extension): it is imported inside each
peer's venv with PYTHONPATH at the checkout, and by the tests in the project's venv.

The attribution file: columns `index` (the pool row, 0-based in the pool file's order) and `attribution`
(one value per target row, in the target file's order), positive where a gradient step on the pool row
LOWERS that target's loss: gradspec align --attribution's convention. A pool row gradspec would not
score (no response token, an unreadable row) has a null attribution, which validate counts as missing.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.common import peak_rss_mib
from gradspec.data.readers import read_samples
from gradspec.data.row_layouts import Fields
from gradspec.data.templates import Tokenized, tokenize
from gradspec.files import atomic_write

ATTRIBUTION_COLUMNS = ("index", "attribution")


@dataclass
class Rows:
    """A file's rows as gradspec tokenizes them: tokens[i] for row i, None where gradspec would not score
    it (status says why)."""

    path: Path
    tokens: list[Tokenized | None]
    status: list[str]

    @property
    def scored(self) -> list[int]:
        """The rows that have tokens, in file order."""
        return [i for i, t in enumerate(self.tokens) if t is not None]


class ListDataset:
    """Items as a map-style dataset (what the peers' data loaders take)."""

    def __init__(self, items: Sequence) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def read_rows(path: str | Path, tokenizer, max_length: int, template: str = "plain") -> Rows:
    """The file's rows (any layout gradspec reads: Alpaca, messages, ShareGPT, prompt-completion) through
    gradspec's reader and template, cut to their first max_length tokens as gradspec's --max-length does."""
    tokens: list[Tokenized | None] = []
    status: list[str] = []
    for sample in read_samples(path, Fields(), on_error="skip"):
        if sample.error:
            tokens.append(None)
            status.append(f"error: {sample.error}")
            continue
        tok = tokenize(sample.messages, tokenizer, template, max_length)
        tokens.append(tok if tok.scorable else None)
        status.append(tok.status)
    return Rows(Path(path), tokens, status)


def read_inputs(args):
    """(tokenizer, pool, target, model) for a driver's --model, --pool, --target, --max-length and --seed:
    torch seeded, the rows read as gradspec reads them, the model in fp32 eval mode. Stops, naming the file,
    where the pool has no row gradspec scores or a target row is one it does not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pool = read_rows(args.pool, tokenizer, args.max_length)
    target = read_rows(args.target, tokenizer, args.max_length)
    if not pool.scored or len(target.scored) != len(target.tokens):
        bad = [f"{i}: {s}" for i, s in enumerate(target.status) if target.tokens[i] is None]
        raise SystemExit(f"{args.target if bad else args.pool}: rows gradspec does not score"
                         + (f" ({'; '.join(bad)})" if bad else " (all of them)") + ": nothing to attribute against")
    return tokenizer, pool, target, AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()


def attribution_frame(scores: np.ndarray, pool: Sequence[int], rows: int, tool: str = "the peer") -> pd.DataFrame:
    """scores (targets, len(pool)): column k holds pool row pool[k]'s score against each target, positive
    where a step on the row lowers the target's loss. -> one row per pool row 0..rows-1 (None where the
    row was not scored). A value that is not finite is refused, naming the row and the target: validate
    would count it as missing, and a peer's NaN is a failed run, not a score."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[1] != len(pool):
        raise ValueError(f"{tool}: scores of shape {scores.shape}, expected (targets, {len(pool)} pool rows)")
    bad = np.argwhere(~np.isfinite(scores))
    if len(bad):
        target, k = bad[0]
        raise ValueError(f"{tool}: {len(bad)} scores are not finite (the first: pool row {pool[k]}, target "
                         f"{target}: {scores[target, k]}); not written")
    column: list[list[float] | None] = [None] * rows
    for k, i in enumerate(pool):
        if not 0 <= i < rows or column[i] is not None:
            raise ValueError(f"{tool}: pool row {i} is out of 0..{rows - 1} or scored twice")
        column[i] = [float(v) for v in scores[:, k]]
    return pd.DataFrame({"index": np.arange(rows, dtype=np.int64), "attribution": column})


def write_parquet(frame: pd.DataFrame, path: str | Path) -> None:
    """frame to path as Parquet, atomically (a stopped run leaves the old file or none)."""
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    atomic_write(path, lambda f: f.write(buffer.getvalue()))


def sidecar_path(out: str | Path) -> Path:
    """Where the JSON beside an attribution file goes: OUT.json (attribution.parquet.json)."""
    out = Path(out)
    return out.with_name(out.name + ".json")


@dataclass
class Run:
    """One peer's run: started when made; write() records the wall time since and the peak RSS (the
    process's VmHWM, as getrusage's ru_maxrss: the model, the tool's factors and stores, the interpreter)
    beside what the caller says."""

    tool: str
    version: str
    method: str
    started: float = field(default_factory=time.perf_counter)

    def record(self, **details: Any) -> dict[str, Any]:
        """The sidecar's fields: tool, version, method, seconds (wall, since this Run was made),
        peak_rss_mib, then details (modules, max_length, rows, targets, the tool's settings)."""
        seconds = time.perf_counter() - self.started
        return {"tool": self.tool, "version": self.version, "method": self.method,
                "seconds": round(seconds, 3), "peak_rss_mib": round(peak_rss_mib(), 1), **details}

    def write(self, out: str | Path, frame: pd.DataFrame, **details: Any) -> dict[str, Any]:
        """The attribution file at out and its sidecar; returns the sidecar's fields."""
        write_parquet(frame, out)
        record = self.record(**details)
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{self.tool}: sidecar field {key} is {value}")
        text = json.dumps(record, indent=2) + "\n"
        atomic_write(sidecar_path(out), lambda f: f.write(text.encode()))
        return record
