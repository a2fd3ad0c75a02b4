"""Evidence with power (issue 53): what the spectra predict beyond length, and what attribution finds where
the task's kind is not the answer, on two tasks of SmolLM2-135M-Instruct retrained on the CPU.

Two pools of 64 rows, each all of the target task's kind, from two sources each, at several lengths, a
known quarter of one source corrupted:
- **reasoning:** 48 gsm8k DeepSeek-R1 traces and 16 s1 R1 traces (competition maths); each response cut
  at a paragraph boundary after a random 200-1,200 characters (seeded), so that lengths spread; 12 of
  the gsm8k rows corrupted: every number of their kept response replaced by a wrong one (the same wrong
  one wherever it recurs), so their steps and results are wrong. Target: 8 other gsm8k traces, whole
  (cut by --max-length alone). --max-length 256.
- **code:** 48 HumanEval problems with their canonical solutions and 16 Python answers from the
  instruction sets (WizardLM, OpenHermes, Magpie; prompts of 600 characters or fewer, so that the answer
  fits); 12 of the HumanEval rows corrupted: each given the
  solution of another corrupted problem (a derangement: working code, for the wrong problem). Target: 8
  other HumanEval problems. --max-length 384.
labels.parquet beside each pool says which rows are which (index, source, corrupted, response_chars).

Retrains, per task: 32 LDS halves (one set for every score); the recipe of validate_findings.py (one
epoch, batch 4, AdamW lr 1e-4, full weights). The runs use one thread each (the thread count is part of
a run's numerics: a resume must match it) and resume where they stopped:

    .venv/bin/python docs/evidence_power.py [OUT] [STAGE ...]     # days of CPU: not run in CI

STAGE (default all, in this order):
- pools: the pools, targets and labels;
- lds: both tasks' LDS retrains;
- peers: kronfluence's EK-FAC and dattri's LoGra on each pool, each in a venv of its own (peers.csv: their
  time and peak memory);
- scores: gradspec align's attributions and per-sample scores (and the peers' where made), and each
  score's AUPRC at finding the corrupted rows (detection.csv);
- outcome: the top quarter by K-FAC, EK-FAC, effective rank, low nuclear norm and low perplexity, plain
  and over 4 length buckets, beside random and length, 3 seeds;
- removal: the top and the bottom 12 rows by K-FAC, effective rank and perplexity left out, beside 12
  random rows, 3 seeds;
- objectives: the whole pool trained with plain next-token training, WIT (train's weights) and SFTMix,
  3 seeds;
- analyse: the reports (each score's LDS and LDS beyond length, the outcome, the removal effects, the
  objectives' gains over NTP: <task>/report_<stage>/).
EVIDENCE_SMOKE=1: a few rows and retrains, to check the script runs end to end (no numbers to keep).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from pools import DATA, gsm8k_samples, instruction_samples, write_jsonl

from gradspec.data.readers import Fields, humaneval_samples, read_samples

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.peers
SMOKE = os.environ.get("EVIDENCE_SMOKE") == "1"
POOL = (6, 2, 2) if SMOKE else (48, 16, 12)  # first source, second source, corrupted (of the first)
TARGETS = 2 if SMOKE else 8
SUBSETS = "3" if SMOKE else "32"
SEEDS = "1" if SMOKE else "3"
MAX_LENGTH = {"reasoning": "128" if SMOKE else "256", "code": "128" if SMOKE else "384"}
RECIPE = ["--batch-size", "4", "--learning-rate", "1e-4", "--epochs", "1"]
TASKS = ("reasoning", "code")


def conversation(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def cut(text: str, rng: random.Random) -> str:
    """text up to the first paragraph end after a random 200-1,200 characters (all of it if shorter)."""
    at = text.find("\n\n", rng.randint(200, 1200))
    return text if at < 0 else text[:at]


def wrong_numbers(text: str, rng: random.Random) -> str:
    """Every number of text replaced by a wrong one, the same wrong one wherever it recurs."""
    wrong: dict[str, str] = {}

    def replace(match: re.Match) -> str:
        n = match.group(0)
        if n not in wrong:
            wrong[n] = str(int(n) + rng.choice([-3, -2, -1, 1, 2, 3, 7, 10]) * (1 + int(n) // 10))
            if wrong[n].startswith("-") or wrong[n] == n:
                wrong[n] = str(int(n) + 1)
        return wrong[n]

    return re.sub(r"\d+", replace, text)


def derangement(n: int, rng: random.Random) -> list[int]:
    """A permutation of range(n) that moves every element (n >= 2)."""
    while True:
        order = list(range(n))
        rng.shuffle(order)
        if all(i != j for i, j in enumerate(order)):
            return order


def reasoning_pool() -> tuple[list[dict], list[dict], list[dict]]:
    first, second, corrupted = POOL
    rng = random.Random(53)
    gsm8k = gsm8k_samples()
    s1 = [s for s in read_samples(DATA / "reasoning/s1_R1.json", Fields()) if len(s.messages[0]["content"]) < 600]
    rows, labels = [], []
    bad = set(rng.sample(range(first), corrupted))
    for k, sample in enumerate(gsm8k[TARGETS:TARGETS + first]):
        prompt, answer = sample.messages[0]["content"], cut(sample.messages[-1]["content"], rng)
        if k in bad:
            answer = wrong_numbers(answer, rng)
        rows.append(conversation(prompt, answer))
        labels.append({"source": "gsm8k", "corrupted": k in bad})
    for sample in s1[:second]:
        rows.append(conversation(sample.messages[0]["content"], cut(sample.messages[-1]["content"], rng)))
        labels.append({"source": "s1", "corrupted": False})
    target = [conversation(s.messages[0]["content"], s.messages[-1]["content"]) for s in gsm8k[:TARGETS]]
    return rows, labels, target


def is_python_answer(sample) -> bool:
    """A one-turn row answered with Python code, its prompt short enough to leave room for the answer."""
    answer = sample.messages[-1]["content"]
    return "```python" in answer and "def " in answer and len(sample.messages) == 2 and \
        len(sample.messages[0]["content"]) <= 600


def code_pool() -> tuple[list[dict], list[dict], list[dict]]:
    first, second, corrupted = POOL
    rng = random.Random(53)
    problems = list(humaneval_samples(TARGETS + first))
    pool = problems[TARGETS:]
    bad = sorted(rng.sample(range(first), corrupted))
    swapped = dict(zip(bad, (bad[j] for j in derangement(len(bad), rng)), strict=True))
    rows, labels = [], []
    for k, sample in enumerate(pool):
        answer = pool[swapped.get(k, k)].messages[-1]["content"]
        rows.append(conversation(sample.messages[0]["content"], answer))
        labels.append({"source": "humaneval", "corrupted": k in swapped})
    python = [s for s in instruction_samples(200) if is_python_answer(s)]
    for sample in python[:second]:
        rows.append(conversation(sample.messages[0]["content"], sample.messages[-1]["content"]))
        labels.append({"source": "instruction", "corrupted": False})
    target = [conversation(s.messages[0]["content"], s.messages[-1]["content"]) for s in problems[:TARGETS]]
    return rows, labels, target


def build(out: Path, task: str) -> tuple[Path, Path]:
    folder = out / task
    folder.mkdir(parents=True, exist_ok=True)
    pool, target = folder / "pool.jsonl", folder / "target.jsonl"
    if not pool.exists():
        rows, labels, targets = reasoning_pool() if task == "reasoning" else code_pool()
        pd.DataFrame([{"index": i, **label, "response_chars": len(row["messages"][-1]["content"])}
                      for i, (row, label) in enumerate(zip(rows, labels, strict=True))]) \
            .to_parquet(folder / "labels.parquet")
        write_jsonl(target, targets)
        write_jsonl(pool, rows)  # last: its presence says the pool is built
    return pool, target


def run(*command: str) -> None:
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def gradspec(*args: str) -> None:
    run(sys.executable, "-m", "gradspec", *args)


def validate(out: Path, task: str, name: str, *extra: str) -> Path:
    """A validate run of task's pool, resumed where it stopped."""
    pool, target = build(out, task)
    path = out / task / f"{name}.parquet"
    if not path.exists():
        resume = ["--resume"] if Path(f"{path}.parts").exists() else []
        gradspec("validate", "--data", str(pool), "--target", str(target), "--out", str(path), "--max-length",
                 MAX_LENGTH[task], *RECIPE, "--quiet", *resume, *extra)
    return path


# Runs gradspec in this process and, at exit, writes its wall time and peak memory to the JSON file sys.argv[1]
# names (the sidecar the peers' attribution files have too: benchmarks/peers/peer_files.py).
TIMED = """import atexit, json, resource, runpy, sys, time
began, sidecar = time.perf_counter(), sys.argv.pop(1)
atexit.register(lambda: open(sidecar, "w").write(json.dumps({"tool": "gradspec", "seconds": time.perf_counter() - began,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})))
sys.argv[0] = "gradspec"
runpy.run_module("gradspec", run_name="__main__")"""


def align(out: Path, task: str, name: str, *extra: str) -> Path:
    """gradspec align's attribution of task's pool to its targets (q/k/v/o, the default modules), its time
    and peak memory beside it (<name>.parquet.json)."""
    pool, target = build(out, task)
    path = out / task / f"{name}.parquet"
    if not path.exists():
        run(sys.executable, "-c", TIMED, f"{path}.json", "align", "--data", str(pool), "--target", str(target),
            "--out", str(path), "--attribution", "--max-length", MAX_LENGTH[task], "--quiet", *extra)
    return path


def scores(out: Path, task: str) -> dict[str, str]:
    """Every score the analysis tests, by label: exact alignment (plain, K-FAC, EK-FAC: attributions), the
    spectra and the classic scores (per sample, from the plain run), and random noise."""
    plain = align(out, task, "plain", "--spectra", "--classic")
    folder = out / task
    found = {"alignment, plain": str(plain),
             "alignment, K-FAC": str(align(out, task, "kfac", "--precondition", "kfac", "--factors",
                                            str(folder / "kfac.safetensors"))),
             "alignment, EK-FAC": str(align(out, task, "ekfac", "--precondition", "ekfac", "--factors",
                                             str(folder / "ekfac.safetensors")))}
    for label, name in PEERS.items():  # once the peers stage has made them
        if (folder / f"{name}.parquet").exists():
            found[label] = str(folder / f"{name}.parquet")
    found.update({label: f"{plain}:{column}" for label, column in PER_SAMPLE.items()})
    noise = folder / "random.parquet"
    if not noise.exists():
        rows = len((folder / "pool.jsonl").read_text().splitlines())
        pd.DataFrame({"index": range(rows), "random": np.random.default_rng(0).standard_normal(rows)}) \
            .to_parquet(noise)
    found["random"] = f"{noise}:random"
    return found


# The per-sample scores, each turned so that high means a good row as its literature reads it (select --by's
# ":-1" turns a column round): the spectra as the seed paper reads them (high effective and stable rank, low
# nuclear norm), IFD's high end (Li et al.'s cherry data), perplexity's low end (perplexity filtering). The
# attributions' high end is a row that lowers the targets' loss. A score's bottom is then its suspect end.
PER_SAMPLE = {"align_mean (plain cosine)": "align_mean", "effective rank": "effective_rank",
              "nuclear norm (low)": "nuclear_norm:-1", "stable rank": "stable_rank", "IFD": "ifd",
              "perplexity (low)": "perplexity:-1"}
SELECTED = ("alignment, K-FAC", "alignment, EK-FAC", "effective rank", "nuclear norm (low)", "perplexity (low)")
REMOVED = ("alignment, K-FAC", "effective rank", "perplexity (low)")  # the removal test's


def average_precision(found: np.ndarray, ranking: np.ndarray) -> float:
    """Average precision (the area under the precision-recall curve as DATE-LM and scikit-learn's
    average_precision_score compute it: the precision at each found row, averaged over the rows to find)
    of a ranking (most suspect first) of rows labelled found (bool)."""
    hits = found[ranking].astype(float)
    return float((np.cumsum(hits) / np.arange(1, len(hits) + 1) * hits).sum() / hits.sum())


def detection(out: Path, task: str, found: dict[str, str]) -> pd.DataFrame:
    """Each score's AUPRC at finding the corrupted rows (its lowest first; ties in row order), with
    a 95% bootstrap interval over rows; random ranking's expectation is the corrupted share."""
    from gradspec.validation.scores import read_score

    labels = pd.read_parquet(out / task / "labels.parquet").sort_values("index")
    corrupted = labels["corrupted"].to_numpy()
    rows, targets = len(labels), len((out / task / "target.jsonl").read_text().splitlines())
    rng = np.random.default_rng(0)
    table = []
    for label, spec in found.items():
        suspect = np.nan_to_num(-read_score(spec, rows, targets, None).per_sample(), nan=-np.inf)  # unscored: last
        ranking = np.argsort(-suspect, kind="stable")
        boot = []
        for _ in range(1000):
            pick = rng.integers(0, rows, rows)
            if corrupted[pick].any():
                boot.append(average_precision(corrupted[pick], np.argsort(-suspect[pick], kind="stable")))
        low, high = np.quantile(boot, [0.025, 0.975])
        table.append({"task": task, "score": label, "auprc": average_precision(corrupted, ranking), "low": low,
                      "high": high, "corrupted_share": corrupted.mean()})
    return pd.DataFrame(table)


PEERS = {"kronfluence 1.0.1 EK-FAC": "kronfluence_ekfac", "dattri 0.3.0 LoGra": "dattri_logra"}


def peers(out: Path, task: str) -> pd.DataFrame:
    """kronfluence's EK-FAC and dattri's LoGra (projection 256: dattri's 4,096 needs 7.5 GiB of Hessians here)
    on task's pool, q/k/v/o, each in a venv of its own (benchmarks/peers); their time and peak memory. dattri's
    TracIn and TRAK do not finish on this CPU (benchmarks/RESULTS.md): not run."""
    from benchmarks.peers.peer_files import sidecar_path
    from benchmarks.peers.peer_runs import dattri, kronfluence

    pool, target = build(out, task)
    made = [kronfluence(out / task, pool, target, int(MAX_LENGTH[task])),
            dattri(out / task, pool, target, "logra", int(MAX_LENGTH[task]), "--proj-dim", "256")]
    rows = [json.loads(sidecar_path(path).read_text()) for path in made]
    return pd.DataFrame([{"task": task, **{k: r.get(k) for k in ("tool", "version", "method", "seconds",
                                                                    "peak_rss_mib")}} for r in rows])


def main(out: Path, stages: list[str]) -> None:
    every = "all" in stages
    for task in TASKS:
        build(out, task)
    if every or "lds" in stages:
        for task in TASKS:
            validate(out, task, "lds", "--subsets", SUBSETS, "--fraction", "0.5")
    if every or "peers" in stages:
        table = pd.concat([peers(out, task) for task in TASKS])
        table.to_csv(out / "peers.csv", index=False)
        print(table.to_markdown(index=False, floatfmt=".0f"))
    if every or "scores" in stages:
        tables = [detection(out, task, scores(out, task)) for task in TASKS]
        pd.concat(tables).to_csv(out / "detection.csv", index=False)
        print(pd.concat(tables).to_markdown(index=False, floatfmt=".3f"))
    if every or "outcome" in stages:  # each score's top quarter, plain and over 4 length buckets, 3 seeds
        for task in TASKS:
            found = scores(out, task)
            validate(out, task, "outcome", "--subsets", "0", "--outcome", *(found[k] for k in SELECTED), "--top",
                     "0.25", "--seeds", SEEDS, "--length-buckets", "4")
    if every or "removal" in stages:  # each score's top and bottom 12 rows (the corrupted count) left out
        for task in TASKS:
            found = scores(out, task)
            validate(out, task, "removal", "--subsets", "0", "--removal", *(found[k] for k in REMOVED), "--remove",
                     str(POOL[2] / sum(POOL[:2])), "--seeds", SEEDS)
    if every or "objectives" in stages:  # the whole pool under NTP, WIT and SFTMix, 3 seeds
        for task in TASKS:
            validate(out, task, "objectives", "--subsets", "0", "--objectives", "sftmix", "wit", "--seeds", SEEDS)
    if every or "analyse" in stages:
        for task in TASKS:
            for name in ("lds", "outcome", "removal", "objectives"):
                retrains = out / task / f"{name}.parquet"
                if retrains.exists():
                    given = ["--scores", *scores(out, task).values()] if name == "lds" else []
                    report = out / task / f"report_{name}"
                    gradspec("validate", "--runs", str(retrains), *given, "--report", str(report), "--overwrite")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/evidence_power"), sys.argv[2:] or ["all"])
