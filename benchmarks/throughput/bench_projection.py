"""How good is the projected store, and how fast is a query? SmolLM2-135M, q/k/v/o of 30 layers.

Accuracy: the pool (HumanEval 0-47) and the task (20 other problems, 100-119) are aligned exactly
(``SpectralEngine.set_task``), and through the Kronecker projection at k = 4, 8, 16, 32 per side. One
pass at k = 32 gives every smaller k (``gradspec.alignment.projection.leading_block``). For the
whole-model `align_mean` and `align_mean_gradient`, printed: Pearson and Spearman correlation with the
exact cosines, the mean absolute error, and how many of the exact top 10 are in the projected top 10.

Query speed: the cosines of a synthetic store of ROWS rows at k = 16 (the dims of these 120 parts)
with a task of 20, streamed from Parquet by ``gradspec.runs.store_query``'s reader, timed apart from
the task's own pass and scaled to a million rows (an estimate, stated as such); the store's size per
million rows is its bytes on disk scaled the same way.
Run with ``pytest benchmarks/throughput/bench_projection.py -s`` (a few minutes on 2 cores).
"""

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from scipy.stats import pearsonr, spearmanr

from benchmarks.common import humaneval_items
from gradspec.alignment.cosines import projected_cosines
from gradspec.alignment.projection import leading_block
from gradspec.data.batching import BATCH_TOKENS, pad_batch, token_batches
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.runs.score_files import PROJECTION
from gradspec.runs.store_query import READ_ROWS, _aligned

KS = (4, 8, 16, 32)
ROWS = 20_000
AGGREGATES = ("mean_gradient", "mean")


def _batches(tok, samples, ordered=False):
    items = humaneval_items(tok, samples)
    groups = [items[i : i + 4] for i in range(0, len(items), 4)] if ordered else token_batches(items, BATCH_TOKENS)
    return [(pad_batch([i.tokens for i in b], tok.pad_token_id, "cpu"), [i.sample.index for i in b]) for b in groups]


@pytest.fixture(scope="module")
def smol():
    model, tok = load_model()
    model.requires_grad_(False)
    return model, tok


def test_projection_error_by_k(smol):
    model, tok = smol
    samples = list(humaneval_samples(120))
    pool, task = _batches(tok, samples[:48]), _batches(tok, samples[100:120], ordered=True)
    big = max(KS)
    engine = SpectralEngine(model, "attn", spectra=False, project=big)
    engine.set_task([b for b, _ in task], AGGREGATES)
    exact, projected, order = {a: [] for a in AGGREGATES}, [], []
    for batch, indices in pool:
        result = engine.score(*batch)
        for a in AGGREGATES:
            exact[a].append(result.alignment[f"align_{a}"])
        projected.append(result.projection)
        order += indices
    from gradspec.runs.store_query import task_vectors

    task_big = task_vectors(engine, [b for b, _ in task])
    exact = {a: torch.cat(v).numpy() for a, v in exact.items()}
    projected = torch.cat(projected)
    parts = len(engine.parts)
    print(f"\npool {len(order)} samples, task {len(task_big)} examples, {parts} parts (q/k/v/o x 30)")
    print("| k | values per sample | aggregate | Pearson | Spearman | mean abs error | exact top 10 in projected's |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for k in KS:
        _, whole = projected_cosines(leading_block(projected, parts, big, k), leading_block(task_big, parts, big, k),
                                     engine.part_names, AGGREGATES)
        for j, a in enumerate(AGGREGATES):
            est = whole[:, j].numpy()
            top = len(set(np.argsort(-exact[a])[:10]) & set(np.argsort(-est)[:10]))
            print(f"| {k} | {parts * k * k:,} | {a} | {pearsonr(exact[a], est)[0]:.3f} | "
                  f"{spearmanr(exact[a], est)[0]:.3f} | {np.abs(exact[a] - est).mean():.4f} | {top}/10 |")


def test_store_query_speed(tmp_path):
    parts, k, m = 120, 16, 20
    dims = parts * k * k
    g = np.random.default_rng(0)
    path = tmp_path / "store.parquet"
    with pq.ParquetWriter(path, pa.schema([("index", pa.int64()), ("status", pa.string()),
                                           (PROJECTION, pa.list_(pa.float32()))])) as writer:
        for start in range(0, ROWS, 2000):
            block = g.standard_normal((2000, dims), dtype=np.float32)
            writer.write_table(pa.table({"index": np.arange(start, start + 2000), "status": ["ok"] * 2000,
                                         PROJECTION: list(block)}))
    size = path.stat().st_size
    task = torch.from_numpy(g.standard_normal((m, dims), dtype=np.float32))
    names = [f"part{i}" for i in range(parts)]
    metrics = tuple(f"align_{a}" for a in AGGREGATES)
    start = time.perf_counter()
    rows = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=READ_ROWS):
        rows += _aligned(batch, ["index", "status"], names, metrics, task, AGGREGATES).num_rows
    seconds = time.perf_counter() - start
    scale = 1_000_000 / rows
    print(f"\nstore of {rows:,} rows x {dims:,} fp32 values (k = {k}, {parts} parts): {size / 2**20:.0f} MiB, "
          f"query with a task of {m} in {seconds:.1f} s; scaled to a million rows (estimate): "
          f"{size * scale / 2**30:.1f} GiB, {seconds * scale / 60:.1f} min")
