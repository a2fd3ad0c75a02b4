"""A store's FAISS index (issue 51, item 4): build time, query time, recall@100 against the exact scan and peak
RSS, on synthetic stores: 1,000,000 rows at k = 4 and 100,000 rows at k = 16, each row 120 parts (SmolLM2-135M's
30 layers of q/k/v/o), so 1,920 and 30,720 float32 values per row, written as `gradspec project` writes a store
(a `projected_gradient` list column, the store's metadata).

The vectors are not a model's: rows fall in clusters (rows/1000 of them, a row = its cluster's centre plus as
much noise, each dimension scaled by i^-1/2 as a spectrum decays), and a task is 20 fresh rows of one cluster, as
a task's examples are of one kind. Queries: three tasks ranked by align_mean (--aggregate mean_gradient,mean),
one by align_mean_gradient, one by align_max. Each query's recall@100: the share of the exact scan's top 100
(the whole-model column, computed as `align --store` computes it, over every row) that --top 100 returns. The
exact scan over all 120 parts is timed on its first 20,480 rows and scaled to the store (an estimate).

Each phase runs in a fresh process (its peak RSS is that process's own, common.peak_rss_mib: VmHWM) pinned to
2 CPUs. The stores and their indexes go under $GRADSPEC_BENCH_CACHE (default /tmp), in store-<rows>-k<k>/, one
at a time, deleted after (--keep: kept and reused): about 15 GB for the first, 25 GB for the second. Run:
``python -m benchmarks.throughput.bench_store [--rows N --k K] [--keep]`` (default: both configurations), a
Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import child_env, peak_rss_mib

PARTS, TASK_ROWS, TOP, EXACT_SAMPLE = 120, 20, 100, 5 * 4096
QUERIES = [(0, ("mean_gradient", "mean")), (1, ("mean_gradient", "mean")), (2, ("mean_gradient", "mean")),
           (0, ("mean_gradient",)), (0, ("max",))]


def _layout(rows: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(cluster centres, per-dimension scale) of the synthetic store."""
    dims = PARTS * k * k
    centres = np.random.default_rng(seed).standard_normal((max(1, rows // 1000), dims), dtype=np.float32)
    return centres, (np.arange(1, dims + 1, dtype=np.float32) ** -0.5)


def make(path: str, rows: int, k: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gradspec.runs.score_files import METADATA_KEY, PROJECTION

    centres, scale = _layout(rows, k)
    dims = len(scale)
    names = [f"model.layers.{i // 4}.self_attn.{'qkvo'[i % 4]}_proj" for i in range(PARTS)]
    meta = {"parts": [], "metrics": [], "project": k, "projection": {"parts": names, "k_in": k, "k_out": k, "seed": 0}}
    schema = pa.schema([("index", pa.int64()), ("status", pa.string()), (PROJECTION, pa.list_(pa.float32()))],
                       metadata={METADATA_KEY: json.dumps(meta).encode()})
    rng = np.random.default_rng(1)
    step = max(1, (32 << 20) // (4 * dims))
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, step):
            n = min(step, rows - start)
            x = (centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, dims), dtype=np.float32)) * scale
            values = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), dims).cast(pa.list_(pa.float32()))
            writer.write_table(pa.table({"index": np.arange(start, start + n), "status": ["ok"] * n,
                                         PROJECTION: values}, schema=schema))


def _task(rows: int, k: int, which: int):
    import torch

    centres, scale = _layout(rows, k)
    rng = np.random.default_rng(100 + which)
    c = centres[which % len(centres)]
    return torch.from_numpy((c + rng.standard_normal((TASK_ROWS, len(scale)), dtype=np.float32)) * scale)


def build(path: str) -> dict:
    from gradspec.runs.store_index import build_index

    header = build_index(path)
    return {"settings": header["settings"], "recall_at_build": header["recall"]["value"],
            "index_bytes": os.path.getsize(f"{path}.faiss"), "vectors_bytes": os.path.getsize(f"{path}.vectors")}


def query(path: str, rows: int, k: int, which: int, aggregates: list[str]) -> dict:
    import pyarrow.parquet as pq

    from gradspec.runs.score_files import read_metadata
    from gradspec.runs.store_index import read_index
    from gradspec.runs.store_query import kept_columns, top_rows

    task = _task(rows, k, which)
    started = time.perf_counter()
    names = read_metadata(path)["projection"]["parts"]
    index = read_index(path)
    reader = pq.ParquetFile(path)
    table, info = top_rows(index, reader, kept_columns(reader), names, task, tuple(aggregates), set(), TOP)
    return {"seconds": time.perf_counter() - started, "rows": table["index"].to_pylist(), "by": info["by"],
            "candidates": info["candidates"]}


def exact(path: str, rows: int, k: int) -> dict:
    """Every query's exact top, in one pass over the store: the whole-model column as `align --store` computes
    it (projected_cosines of the store's values, whole vectors), and the all-parts scan timed on a sample."""
    import pyarrow.parquet as pq
    import torch

    from gradspec.alignment.cosines import projected_cosines
    from gradspec.runs.score_files import PROJECTION, read_metadata
    from gradspec.runs.store_query import kept_columns, ranked_by, scanned

    reader = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)  # as align --store reads it
    tasks = [(_task(rows, k, w), tuple(a)) for w, a in QUERIES]
    values: list[list[np.ndarray]] = [[] for _ in tasks]
    dims = PARTS * k * k
    started = time.perf_counter()
    for batch in reader.iter_batches(batch_size=4096, columns=[PROJECTION]):
        flat = batch.column(0).flatten().to_numpy(zero_copy_only=False)  # every synthetic row has its vector
        pool = torch.from_numpy(np.asarray(flat, np.float64).reshape(-1, dims))
        for q, (task, aggregates) in enumerate(tasks):
            whole = projected_cosines(pool, task, ["model"], aggregates)[1]
            values[q].append(whole[:, aggregates.index(ranked_by(aggregates)[len("align_"):])].numpy())
    whole_s = time.perf_counter() - started
    tops = [np.argsort(-np.concatenate(v), kind="stable")[:TOP].tolist() for v in values]
    names = read_metadata(path)["projection"]["parts"]
    started, seen = time.perf_counter(), 0
    for table in scanned(reader, kept_columns(reader), names, tasks[0][0], tasks[0][1], set()):
        seen += table.num_rows
        if seen >= EXACT_SAMPLE:
            break
    full_s = (time.perf_counter() - started) * rows / seen
    return {"tops": tops, "whole_model_scan_s": whole_s, "all_parts_scan_s_estimate": full_s}


def _child(phase: str, *args) -> dict:
    """phase run in a fresh process on CPUs 0-1: its result, wall seconds and peak RSS."""
    command = [sys.executable, __file__, "--phase", phase, *map(str, args)]
    env = child_env(OMP_NUM_THREADS="2")
    started = time.perf_counter()
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    print(phase, json.dumps({k: v for k, v in result.items() if k not in ("rows", "tops")}), file=sys.stderr,
          flush=True)
    return result


def run(rows: int, k: int, root: Path, keep: bool) -> dict:
    folder = root / f"store-{rows}-k{k}"
    folder.mkdir(parents=True, exist_ok=True)
    store, done = folder / "store.parquet", folder / "made"
    try:
        made = {"wall_s": None}
        if not done.exists():  # a kept store is reused
            made = _child("make", store, rows, k)
            done.write_text("")
        built = _child("build", store)
        queries = [_child("query", store, rows, k, w, ",".join(a)) for w, a in QUERIES]
        cached = folder / "exact.json"  # the exact answers do not depend on the index: kept with the store
        scan = json.loads(cached.read_text()) if keep and cached.exists() else _child("exact", store, rows, k)
        if keep:
            cached.write_text(json.dumps(scan))
        for q, found in zip(queries, scan["tops"], strict=True):
            q["recall"] = len(set(q.pop("rows")) & set(found)) / len(found)
        return {"rows": rows, "k": k, "dims": PARTS * k * k, "store_bytes": store.stat().st_size,
                "make_s": made["wall_s"], "build": built, "queries": queries,
                "exact": {key: v for key, v in scan.items() if key != "tops"}}
    finally:
        if not keep:
            shutil.rmtree(folder)


def table(results: list[dict]) -> str:
    lines = ["| store | index | build: wall, CPU, peak RSS | index + vectors on disk | query: in-process (median, "
             "max), process wall (max), CPU (max) | peak RSS query | recall@100 (min, mean) | exact scan: whole model "
             "/ all parts (est.) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        b, qs, e = r["build"], r["queries"], r["exact"]
        s = b["settings"]
        times = sorted(q["seconds"] for q in qs)
        lines.append(
            f"| {r['rows']:,} rows, k = {r['k']} ({r['dims']:,} values, {r['store_bytes'] / 1e9:.1f} GB) "
            f"| {s['kind']} over {s.get('reduced', s['dims'])} dims, nprobe {s['nprobe']} "
            f"(recall at build {b['recall_at_build']:.3f}) "
            f"| {b['wall_s']:.0f} s, {b['cpu_s']:.0f} s, {b['peak_rss_mb']:,.0f} MB "
            f"| {b['index_bytes'] / 1e6:,.0f} MB + {b['vectors_bytes'] / 1e9:.1f} GB "
            f"| {times[len(times) // 2]:.1f} s, {times[-1]:.1f} s; {max(q['wall_s'] for q in qs):.1f} s; "
            f"{max(q['cpu_s'] for q in qs):.1f} s | {max(q['peak_rss_mb'] for q in qs):,.0f} MB "
            f"| {min(q['recall'] for q in qs):.2f}, {np.mean([q['recall'] for q in qs]):.3f} "
            f"| {e['whole_model_scan_s']:.0f} s / {e['all_parts_scan_s_estimate']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase")
    p.add_argument("args", nargs="*")
    p.add_argument("--rows", type=int)
    p.add_argument("--k", type=int)
    p.add_argument("--keep", action="store_true", help="keep the stores (reused by a later run)")
    a = p.parse_args()
    if a.phase:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:2]))
        args = a.args
        if a.phase == "make":
            out = make(args[0], int(args[1]), int(args[2])) or {}
        elif a.phase == "build":
            out = build(args[0])
        elif a.phase == "query":
            out = query(args[0], int(args[1]), int(args[2]), int(args[3]), args[4].split(","))
        else:
            out = exact(args[0], int(args[1]), int(args[2]))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["peak_rss_mb"], out["cpu_s"] = peak_rss_mib(), usage.ru_utime + usage.ru_stime
        print(json.dumps(out))
        return
    configs = [(a.rows, a.k)] if a.rows else [(1_000_000, 4), (100_000, 16)]
    root = Path(os.environ.get("GRADSPEC_BENCH_CACHE", tempfile.gettempdir()))
    results = []
    for rows, k in configs:
        results.append(run(rows, k, root, a.keep))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
