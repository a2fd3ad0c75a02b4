"""Preconditioned exact attribution: `gradspec align --precondition none|kfac|ekfac|adam --attribution`
against bergson 2.5.1's none / kfac / ekfac, on SmolLM2-135M-Instruct (CPU).

Pool: HumanEval 0-15; target: HumanEval 100-103 (prompt as instruction, canonical solution as
output, written as Alpaca JSONL); plain template; q/k/v/o of all 30 layers on both sides. Every row
is one subprocess of the command a user runs, so every wall time includes the interpreter, the
imports and the model load; peak RSS is that process's own (VmHWM, common.with_peak_rss). Rows:

- gradspec align, plain: ``--attribution`` (per pool row, the whole-model inner product of its
  gradient with each target row's gradient), no preconditioner;
- gradspec align, K-FAC / EK-FAC: ``--precondition kfac|ekfac --factors F`` with F removed before
  each round, so each run fits the factors on the pool (its default ``--fit-data``) and writes them:
  the fit is inside the row's time, and ``fit_factors``'s own time is printed apart (the driver
  below wraps it with a timer: nothing else of the run changes);
- gradspec align, Adam: ``--model CKPT --precondition adam --optimizer-state CKPT``, CKPT a
  transformers Trainer checkpoint made once before the timing (2 AdamW steps, batches of 4 pool
  rows in Trainer's shuffled order, gradspec's WITCollator labels (the response), lr 1e-5, constant
  schedule, saved at the end, ``processing_class=tokenizer``): it scores the checkpoint's weights,
  not the base model's;
- bergson, none / kfac / ekfac: ``benchmarks/peers/bergson_scores.py`` through ``bergson_filtered.py``
  (bergson's own ``filter_modules`` set to ``*.mlp.*,lm_head``, so bergson keeps q/k/v/o too), with
  ``--loss-reduction mean`` (gradspec's per-sample loss is the mean over response tokens), no
  projection, fp32 (bergson_scores' default), run with the venv's python that
  ``benchmarks/peers/bergson_env.sh`` makes (made here first, outside the timing, unless it exists).
  bergson_scores.py has no Adam route: no bergson Adam row. Besides the subprocess wall, bergson's
  own times are printed: the driver's total after its imports (tokenizer load to scores written)
  and, for kfac/ekfac, the stage times bergson's hessian_pipeline prints (query build, Hessian fit).

Agreement: Spearman between gradspec's and bergson's scores of the same method, over the 64
(pool, target) pairs and over the 16 per-pool means over the targets (the last round's outputs);
bergson's K-FAC samples its Fisher's labels from the model, so its rounds are also compared with
each other. Rows are timed over ROUNDS interleaved rounds (conftest.interleaved_rounds: each round
starts at another row); medians are printed with the ratio to gradspec's plain align.

Run with ``pytest benchmarks/peers/bench_preconditioned.py -s``. Slow on a CPU: one round (every row once)
took about 45 minutes on 2 cores shared with two other jobs (2026-12-03), so BENCH_ROUNDS=2, the
default, is about 1.5 hours there. Each run's wall, peak RSS and inner times are also saved beside
its log and output (WORK/<row>.<round>.json): ``python benchmarks/peers/bench_preconditioned.py --report
[ROUND]`` prints the table again from them (the rounds that completed, if a run was stopped; or one
round's, counted from 0: rounds run under different loads do not make a median). Settings:
BENCH_ROUNDS; BENCH_FIRST_ROUND (continue a stopped run: its rounds from this number on, then the
table of every saved round); BENCH_PRECOND_DIR (the work folder, default /tmp/bench-precond); BERGSON_ENV_DIR
(where bergson_env.sh's venv is or is made, default /tmp/bergson-bench); BENCH_SMOKE=1 (2 pool
rows, 1 target, 1 round, 1 training step: a check that every row runs, no numbers to keep).
"""

import ast
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from benchmarks.common import REPO, interleaved_rounds, peak_rss_in, with_peak_rss

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
ROUNDS = 1 if SMOKE else int(os.environ.get("BENCH_ROUNDS", "2"))
FIRST_ROUND = int(os.environ.get("BENCH_FIRST_ROUND", "0"))  # > 0: more rounds of a stopped run (records kept)
POOL, TARGET = (range(0, 2), range(100, 101)) if SMOKE else (range(0, 16), range(100, 104))
WORK = Path(os.environ.get("BENCH_PRECOND_DIR", "/tmp/bench-precond")) / ("smoke" if SMOKE else "full")
BERGSON_DIR = Path(os.environ.get("BERGSON_ENV_DIR", "/tmp/bergson-bench"))
BERGSON_PY = BERGSON_DIR / ".venv-bergson" / "bin" / "python"
ROWS = ("gradspec plain", "gradspec K-FAC", "gradspec EK-FAC", "gradspec Adam", "bergson none", "bergson kfac",
        "bergson ekfac")
NOT_QKVO = "*.mlp.*,lm_head"  # bergson's filter_modules: what it leaves out
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR = (1, 2, 1e-5) if SMOKE else (2, 4, 1e-5)

# gradspec's CLI, with fit_factors timed (printed as one JSON line); nothing else differs from `gradspec align`.
GRADSPEC_DRIVER = """
import json, sys, time
t0 = time.perf_counter()
import gradspec.runs.preconditioning as p
from gradspec.cli import main
fitted = []
fit = p.fit_factors
def timed(*a, **k):
    s = time.perf_counter(); out = fit(*a, **k); fitted.append(time.perf_counter() - s); return out
p.fit_factors = timed
t1 = time.perf_counter()
code = main(sys.argv[1:])
print("GRADSPEC_TIMES " + json.dumps({"import_s": t1 - t0, "main_s": time.perf_counter() - t1, "fit_s": sum(fitted)}))
sys.exit(code)
"""


def _spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(np.asarray(a).ravel(), np.asarray(b).ravel()).statistic)


def _run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, float, str]:
    """(wall s, peak RSS MiB, output) of one Python subprocess; its output also kept in log."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(with_peak_rss(cmd), stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        _, status, _ = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    text = log.read_text()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed; the end of {log}:\n{text[-3000:]}")
    return wall, peak_rss_in(text), text


def _write_jsonl(samples, path: Path) -> Path:
    rows = [{"instruction": s.messages[0]["content"], "output": s.messages[1]["content"]} for s in samples]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trainer_checkpoint(model_dir: Path, pool: Path, out: Path) -> Path:
    """A few AdamW steps of transformers' Trainer on the pool, saved at the end (optimizer.pt)."""
    import torch
    from transformers import Trainer, TrainingArguments

    from gradspec.data.models import load_model
    from gradspec.training.wit import WITCollator

    checkpoint = out / f"checkpoint-{TRAIN_STEPS}"
    if (checkpoint / "optimizer.pt").is_file():
        return checkpoint
    torch.manual_seed(0)
    model, tokenizer = load_model(str(model_dir))
    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=TRAIN_BATCH, max_steps=TRAIN_STEPS,
                             learning_rate=TRAIN_LR, lr_scheduler_type="constant", save_strategy="steps",
                             save_steps=TRAIN_STEPS, report_to=[], use_cpu=True, remove_unused_columns=False,
                             seed=0)
    Trainer(model=model, args=args, train_dataset=rows, data_collator=WITCollator(tokenizer),
            processing_class=tokenizer).train()
    return checkpoint


@pytest.fixture(scope="module")
def setup():
    from gradspec.data.models import default_model_path
    from gradspec.data.readers import humaneval_samples

    WORK.mkdir(parents=True, exist_ok=True)
    samples = list(humaneval_samples(TARGET.stop))
    pool = _write_jsonl([samples[i] for i in POOL], WORK / "pool.jsonl")
    target = _write_jsonl([samples[i] for i in TARGET], WORK / "target.jsonl")
    model_dir = default_model_path()
    if not BERGSON_PY.exists():
        start = time.perf_counter()
        with open(WORK / "bergson_env.log", "w") as log:
            subprocess.run(["bash", "benchmarks/peers/bergson_env.sh", str(BERGSON_DIR)], stdout=log,
                           stderr=subprocess.STDOUT, cwd=REPO, check=True)
        print(f"\nbergson venv made in {time.perf_counter() - start:.0f} s (not timed)")
    start = time.perf_counter()
    checkpoint = _trainer_checkpoint(model_dir, pool, WORK / "trainer")
    print(f"\nTrainer checkpoint {checkpoint} ready in {time.perf_counter() - start:.0f} s (not timed)")
    return model_dir, pool, target, checkpoint


def _bergson_times(text: str) -> dict:
    """bergson_scores' total after its imports, and the stage times bergson's hessian_pipeline prints."""
    stages = re.search(r"Step timings \(s\): (\{.*?\})", text)
    return {"internal_s": float(re.search(r"\(([\d.]+) s, bergson stores in", text).group(1)),
            "stages": ast.literal_eval(stages.group(1)) if stages else {}}


def _scores(name: str, out: Path) -> np.ndarray:
    """(pool, target) scores of one run's output: gradspec's attribution column, bergson's score rows."""
    if name.startswith("gradspec"):
        df = pd.read_parquet(out).sort_values("index")
        return np.array([list(v) for v in df["attribution"]], dtype=np.float64)
    frame = pd.read_parquet(out)
    frame = frame[frame.target_index != "mean"]
    grid = frame.pivot(index="pool_index", columns="target_index", values="score")
    return grid[sorted(grid.columns, key=int)].to_numpy(np.float64)


def _gradspec_row(name, pool, target, model_dir, extra, results):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    factors = WORK / f"{name}.factors.safetensors"

    def row():
        r = FIRST_ROUND + len(results[name])
        factors.unlink(missing_ok=True)  # fitted again every round
        out = WORK / f"{name}.{r}.parquet"
        args = ["align", "--data", str(pool), "--target", str(target), "--modules", "attn", "--attribution",
                "--out", str(out), "--overwrite", "--quiet", "--model", str(model_dir),
                *[str(factors) if a == "FACTORS" else str(a) for a in extra]]
        wall, rss, text = _run([sys.executable, "-c", GRADSPEC_DRIVER, *args], WORK / f"{name}.{r}.log", env)
        times = json.loads(re.search(r"GRADSPEC_TIMES (\{.*\})", text).group(1))
        factor_mib = factors.stat().st_size / 2**20 if factors.exists() else None
        record = {"wall": wall, "rss": rss, "factor_mib": factor_mib, **times}
        (WORK / f"{name}.{r}.json").write_text(json.dumps(record))
        results[name].append({**record, "scores": _scores(name, out)})

    return row


def _bergson_row(name, method, pool, target, model_dir, results):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def row():
        r = FIRST_ROUND + len(results[name])
        work = WORK / f"{name}.store"
        shutil.rmtree(work, ignore_errors=True)
        out = WORK / f"{name}.{r}.parquet"
        cmd = [str(BERGSON_PY), "benchmarks/peers/bergson_filtered.py", "--filter-modules", NOT_QKVO,
               "--model", str(model_dir), "--pool", str(pool), "--target", str(target), "--out", str(out),
               "--preconditioner", method, "--loss-reduction", "mean", "--projection", "0", "--workdir", str(work)]
        wall, rss, text = _run(cmd, WORK / f"{name}.{r}.log", env)
        info = next(work.rglob("query/info.json"))
        record = {"wall": wall, "rss": rss, "modules": len(json.loads(info.read_text())["grad_sizes"]),
                  **_bergson_times(text)}
        (WORK / f"{name}.{r}.json").write_text(json.dumps(record))
        results[name].append({**record, "scores": _scores(name, out)})

    return row


def test_preconditioned_vs_bergson(setup):
    model_dir, pool, target, checkpoint = setup
    results: dict[str, list[dict]] = {}
    rows = {}
    for name, extra in [("gradspec plain", []),
                        ("gradspec K-FAC", ["--precondition", "kfac", "--factors", "FACTORS"]),
                        ("gradspec EK-FAC", ["--precondition", "ekfac", "--factors", "FACTORS"]),
                        ("gradspec Adam", ["--precondition", "adam", "--optimizer-state", checkpoint])]:
        results[name] = []
        rows[name] = _gradspec_row(name, pool, target, checkpoint if name == "gradspec Adam" else model_dir,
                                   extra, results)
    for name, method in [("bergson none", "none"), ("bergson kfac", "kfac"), ("bergson ekfac", "ekfac")]:
        results[name] = []
        rows[name] = _bergson_row(name, method, pool, target, model_dir, results)

    names = list(rows)
    start = FIRST_ROUND % len(names)  # a continued run starts its rounds where the next round would have
    interleaved_rounds({n: rows[n] for n in names[start:] + names[:start]}, ROUNDS)
    if FIRST_ROUND:
        report(saved_results())
    else:
        report(results)


def saved_results(only: int | None = None) -> dict[str, list[dict]]:
    """The runs' saved records (WORK/<row>.<round>.json; only: that round's, counted from 0) with their
    scores, for ``--report``."""
    results = {}
    for name in ROWS:
        runs = sorted(WORK.glob(f"{name}.*.json"), key=lambda p: int(p.name.split(".")[-2]))
        runs = [p for p in runs if only is None or int(p.name.split(".")[-2]) == only]
        results[name] = [{**json.loads(p.read_text()), "scores": _scores(name, p.with_suffix(".parquet"))}
                         for p in runs]
    return results


def report(results: dict[str, list[dict]]) -> None:
    """The table, the times within the runs and the reference Spearman values."""
    rounds = min(len(res) for res in results.values())
    med = {name: statistics.median(r["wall"] for r in res) for name, res in results.items()}
    base = med["gradspec plain"]
    pairs = {"gradspec plain": "bergson none", "gradspec K-FAC": "bergson kfac", "gradspec EK-FAC": "bergson ekfac"}
    agreement = {}
    for g, b in pairs.items():
        G, B = results[g][-1]["scores"], results[b][-1]["scores"]
        agreement[g] = agreement[b] = (_spearman(G, B), _spearman(G.mean(1), B.mean(1)))
    n_pool, n_target = results["gradspec plain"][-1]["scores"].shape
    print(f"\npool {n_pool} x target {n_target}, q/k/v/o of 30 layers (bergson kept "
          f"{results['bergson none'][-1]['modules']} modules); median of {rounds} round(s); wall: the whole "
          "subprocess (interpreter, imports, model load, run)")
    print(f"| row | median wall (s) | ratio to gradspec plain | peak RSS (MiB) | Spearman with the other tool, "
          f"{n_pool * n_target} pairs / {n_pool} pool means | rounds (s) |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for name, res in results.items():
        walls = ", ".join(f"{r['wall']:.1f}" for r in res)
        rho = agreement.get(name)
        rho_text = f"{rho[0]:.3f} / {rho[1]:.3f}" if rho else "— (no bergson Adam route)"
        rss = [r["rss"] for r in res if r.get("rss")]
        rss_text = f"{max(rss):,.0f}" if rss else "not measured"
        print(f"| {name} | {med[name]:.1f} | {med[name] / base:.2f}× | {rss_text} | "
              f"{rho_text} | {walls} |")
    print("\nwithin the runs:")
    for name, res in results.items():
        if name.startswith("gradspec"):
            fit = [r["fit_s"] for r in res]
            print(f"  {name}: imports {statistics.median(r['import_s'] for r in res):.1f} s, cli main "
                  f"{statistics.median(r['main_s'] for r in res):.1f} s"
                  + (f", of which fit_factors {statistics.median(fit):.1f} s (rounds: "
                     f"{', '.join(f'{f:.1f}' for f in fit)}), factors file {res[-1]['factor_mib']:.0f} MiB"
                     if any(fit) else ""))
        else:
            stages = {k: statistics.median(r["stages"].get(k, float("nan")) for r in res) for k in res[-1]["stages"]}
            internal = statistics.median(r["internal_s"] for r in res)
            print(f"  {name}: bergson_scores total after its imports {internal:.1f} s"
                  + (", bergson's stage timings " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items())
                     if stages else ""))
    print("\nreference Spearman (pairs / pool means), last round:")
    for a, b in [("gradspec K-FAC", "gradspec plain"), ("gradspec EK-FAC", "gradspec plain"),
                 ("gradspec EK-FAC", "gradspec K-FAC"), ("gradspec Adam", "gradspec plain"),
                 ("bergson kfac", "bergson none"), ("bergson ekfac", "bergson none"),
                 ("bergson ekfac", "bergson kfac"), ("gradspec K-FAC", "bergson ekfac"),
                 ("gradspec EK-FAC", "bergson kfac")]:
        A, B = results[a][-1]["scores"], results[b][-1]["scores"]
        print(f"  {a} vs {b}: {_spearman(A, B):.3f} / {_spearman(A.mean(1), B.mean(1)):.3f}")
    for name in ("bergson none", "bergson kfac", "bergson ekfac", "gradspec K-FAC", "gradspec EK-FAC"):
        res = results[name]
        if len(res) > 1:
            first, last = res[0]["scores"], res[-1]["scores"]
            print(f"  {name}, round 1 vs round {len(res)}: {_spearman(first, last):.4f}; largest difference "
                  f"relative to the largest score {np.abs(first - last).max() / np.abs(last).max():.1e}")
    G, B = results["gradspec plain"][-1]["scores"], results["bergson none"][-1]["scores"]
    print("  gradspec plain vs bergson none, largest difference relative to the largest score: "
          f"{np.abs(G - B).max() / np.abs(G).max():.1e}")
    for name, res in results.items():
        assert np.isfinite(res[-1]["scores"]).all(), name


if __name__ == "__main__":  # the table again, from the saved runs: --report [ROUND] (one round's, from 0)
    if not sys.argv[1:2] == ["--report"] or len(sys.argv) > 3:
        sys.exit("usage: bench_preconditioned.py --report [ROUND]  (the benchmark itself: pytest benchmarks/"
                 "bench_preconditioned.py -s)")
    report(saved_results(int(sys.argv[2]) if len(sys.argv) == 3 else None))
