"""Retrieval on real data: does a sample's gradient alignment with 20 examples of one kind find
the pool's samples of that kind? Reproduces the table in docs/findings.md.

Pool: 60 instruction samples (20 each of WizardLM, OpenHermes, Magpie: the reward-highest files),
60 DeepSeek-R1 gsm8k traces and 60 HumanEval problems; task sets: 20 held-out examples of each kind.
SmolLM2-135M-Instruct, plain template, q/k/v/o of all 30 layers, max_length 512. Scores per pool
sample, for each task kind: exact alignment (align_mean, align_mean_gradient: whole model), the
projected store's estimate at k = 4, 8, 16 (from one pass at k = 16: see bench_projection.py for
the sub-block identity), the cosine of mean last hidden states (an embedding baseline), the
effective rank (spectra alone: the same ranking whatever the task) and random order. Printed:
precision at 20 and at 60 of the same kind.

    .venv/bin/python docs/align_retrieval.py [OUT]      # about 40 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from pools import DATA, gsm8k_samples

from gradspec.alignment.cosines import projected_cosines
from gradspec.alignment.projection import leading_block
from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, token_batches
from gradspec.data.models import load_model
from gradspec.data.readers import Fields, humaneval_samples, read_samples
from gradspec.data.templates import tokenize
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.runs.store_query import task_vectors

MAX_LENGTH, K, BIG = 512, (4, 8, 16), 16
KINDS = ("instruction", "reasoning", "code")


def samples_by_kind():
    """(pool, tasks): 60 pool and 20 task samples of each kind, disjoint."""
    instruction = []
    for source in ("wiz", "her", "mag"):
        instruction += list(read_samples(DATA / f"reward/{source}_10k_highest_200.json", Fields()))[:27]
    reasoning = gsm8k_samples()[:80]
    code = list(humaneval_samples(80))
    random.Random(0).shuffle(instruction)
    kinds = {"instruction": instruction[:80], "reasoning": reasoning, "code": code}
    return ({k: v[:60] for k, v in kinds.items()}, {k: v[60:80] for k, v in kinds.items()})


def batches(tok, samples):
    """Right-padded batches, and each batch's positions in samples."""
    items = [(i, Item(s, tokenize(s.messages, tok, "plain", MAX_LENGTH))) for i, s in enumerate(samples)]
    items = [(i, it) for i, it in items if it.tokens.scorable]
    index = {id(it): i for i, it in items}
    return [(pad_batch([it.tokens for it in b], tok.pad_token_id, "cpu"), [index[id(it)] for it in b])
            for b in token_batches([it for _, it in items], BATCH_TOKENS)]


@torch.no_grad()
def mean_hidden(model, batch):
    ids, mask, _ = batch
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def precision(scores: np.ndarray, is_kind: np.ndarray, k: int) -> float:
    finite = np.where(np.isfinite(scores), scores, -np.inf)
    return float(is_kind[np.argsort(-finite, kind="stable")[:k]].mean())


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model()
    model.requires_grad_(False)
    pool_by_kind, tasks = samples_by_kind()
    pool = [s for k in KINDS for s in pool_by_kind[k]]
    kind = np.array([k for k in KINDS for _ in pool_by_kind[k]])
    pool_batches = batches(tok, pool)
    task_batches = {k: [b for b, _ in batches(tok, tasks[k])] for k in KINDS}
    n = len(pool)
    scores: dict[str, dict[str, np.ndarray]] = {k: {} for k in KINDS}
    embeddings = np.full((n, model.config.hidden_size), np.nan)
    projected = torch.full((n, 120 * BIG * BIG), torch.nan)
    effective_rank = np.full(n, np.nan)
    start = time.perf_counter()
    for t, k in enumerate(KINDS):
        engine = SpectralEngine(model, "attn", spectra=t == 0, project=BIG if t == 0 else 0)
        engine.set_task(task_batches[k], "mean_gradient,mean")
        exact = {a: np.full(n, np.nan) for a in ("align_mean", "align_mean_gradient")}
        for batch, rows in pool_batches:
            result = engine.score(*batch)
            for a in exact:
                exact[a][rows] = result.alignment[a].numpy()
            if t == 0:
                projected[rows] = result.projection
                ranks = [result.metrics[p][:, engine.metric_names.index("effective_rank")] for p in engine.part_names]
                effective_rank[rows] = torch.stack(ranks, 1).mean(1).numpy()
                embeddings[rows] = mean_hidden(model, batch).numpy()
        scores[k].update(exact)
        if t == 0:
            store_engine = engine
        print(f"{k}: aligned in {time.perf_counter() - start:.0f} s", flush=True)
    parts = len(store_engine.parts)
    for k in KINDS:
        task_big = task_vectors(store_engine, task_batches[k])
        for small in K:
            _, whole = projected_cosines(leading_block(projected.double(), parts, BIG, small),
                                         leading_block(task_big.double(), parts, BIG, small),
                                         store_engine.part_names, ("mean",))
            scores[k][f"projected k={small}"] = whole[:, 0].numpy()
        task_embedding = np.concatenate([mean_hidden(model, b).numpy() for b in task_batches[k]]).mean(0)
        scores[k]["mean hidden state cosine"] = (embeddings @ task_embedding) / (
            np.linalg.norm(embeddings, axis=1) * np.linalg.norm(task_embedding))
        scores[k]["effective rank (no task)"] = effective_rank
        scores[k]["random"] = np.random.default_rng(0).permutation(n).astype(float)
    lines = ["| score | " + " | ".join(f"{k} P@20 | {k} P@60" for k in KINDS) + " |",
             "|---|" + "---:|" * (2 * len(KINDS))]
    for name in scores[KINDS[0]]:
        cells = [f"{precision(scores[k][name], kind == k, at):.2f}" for k in KINDS for at in (20, 60)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    (out / "retrieval.md").write_text(table + "\n")
    np.savez(out / "retrieval_scores.npz", kind=kind,
             **{f"{k}/{name}": v for k in KINDS for name, v in scores[k].items()})
    print(json.dumps({"pool": n, "seconds": round(time.perf_counter() - start)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/align_retrieval"))
