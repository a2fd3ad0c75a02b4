"""Which scores predict what training does? The retraining evidence of docs/findings.md (issue 38):
the LDS and the selection outcome of exact alignment (plain, K-FAC, EK-FAC, Adam summed over two
checkpoints), each spectral metric, IFD, perplexity, length, random and a filter by the target's kind,
and bergson 2.5.1's own K-FAC and EK-FAC scores (its build and query on the same model, modules, data
and loss), all through the same retrains of SmolLM2-135M-Instruct on the CPU.

Pool: 64 instruction samples (WizardLM, OpenHermes, Magpie: the reward, IFD and difficulty subsets,
high and low), 32 gsm8k R1 traces and 32 HumanEval problems, as Alpaca rows; target: 8 other gsm8k
traces. max_length 256, plain template, q/k/v/o. Retrains: one epoch, batch 4, lr 1e-4. The LDS: 16
random halves of the pool, one set of retrains for every score. The outcome: the top quarter by
alignment (plain, K-FAC, EK-FAC, Adam), bergson's EK-FAC, nuclear norm, effective rank, IFD and the
pool's gsm8k rows (the filter by kind), beside random and length, over 3 seeds (no length buckets:
time; validate --length-buckets adds them).

    .venv/bin/python docs/validate_findings.py [OUT]    # hours on 2 CPU cores: not run in CI

Every step is skipped where its output exists and the retrains resume, so a stopped run is run again
with the same command. bergson lives in a venv of its own (benchmarks/peers/bergson_env.sh, made under OUT
unless BERGSON_PYTHON names its python). FINDINGS_SMOKE=1: a few rows and retrains, to check the
script runs end to end (no numbers to keep).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from pools import gsm8k_samples, instruction_samples, write_jsonl

from gradspec.data.readers import Fields, humaneval_samples
from gradspec.runs.checkpoint_sum import sum_over_checkpoints

REPO = Path(__file__).resolve().parents[1]
SMOKE = os.environ.get("FINDINGS_SMOKE") == "1"
MAX_LENGTH = "128" if SMOKE else "256"
SIZES = (6, 3, 3, 2) if SMOKE else (64, 32, 32, 8)  # instruction, gsm8k, HumanEval, target
RECIPE = ["--max-length", MAX_LENGTH, "--batch-size", "4", "--learning-rate", "1e-4", "--epochs", "1"]
SUBSETS, SEEDS = ("3", "1") if SMOKE else ("16", "3")
GRADSPEC = str(Path(sys.executable).parent / "gradspec")
PER_SAMPLE = ["align_mean", "nuclear_norm", "effective_rank", "spectral_norm", "stable_rank", "ifd", "perplexity",
              "response_chars"]


def alpaca(sample) -> dict:
    """A one-turn conversation as an Alpaca row (what bergson_scores.py reads; gradspec reads both)."""
    user = next(m["content"] for m in sample.messages if m["role"] == "user")
    answer = next(m["content"] for m in sample.messages if m["role"] == "assistant")
    return {"instruction": user, "output": answer}


def build(out: Path) -> tuple[Path, Path]:
    n_instruction, n_gsm8k, n_code, n_target = SIZES
    instruction, gsm8k = instruction_samples(12), gsm8k_samples()
    pool = instruction[:n_instruction] + gsm8k[:n_gsm8k] + list(humaneval_samples(n_code))
    target = gsm8k[n_gsm8k:n_gsm8k + n_target]
    return (write_jsonl(out / "pool.jsonl", [alpaca(s) for s in pool]),
            write_jsonl(out / "target.jsonl", [alpaca(s) for s in target]))


def run(*command: str) -> None:
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def align(out: Path, pool: Path, target: Path, name: str, *extra: str) -> Path:
    path = out / f"{name}.parquet"
    if not path.exists():
        run(GRADSPEC, "align", "--data", str(pool), "--target", str(target), "--out", str(path), "--attribution",
            "--max-length", MAX_LENGTH, "--quiet", *extra)
    return path


def adam_checkpoints(out: Path, pool: Path) -> list[Path]:
    """LESS's warm-up: two epochs of transformers' Trainer on a quarter of the pool (constant lr 2e-5), a
    checkpoint (weights and AdamW state) after each."""
    folder = out / "warmup"
    found = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if len(found) == 2:
        return found
    import torch
    from transformers import Trainer, TrainingArguments

    from gradspec.data.models import load_model
    from gradspec.data.readers import read_samples as rows_of
    from gradspec.training.wit import WITCollator

    torch.manual_seed(0)
    model, tokenizer = load_model()
    rows = [{"messages": s.messages} for s in rows_of(pool, Fields())]
    rows = random.Random(1).sample(rows, max(4, len(rows) // 4))
    args = TrainingArguments(output_dir=str(folder), per_device_train_batch_size=4, num_train_epochs=2,
                             learning_rate=2e-5, lr_scheduler_type="constant", save_strategy="epoch", report_to=[],
                             use_cpu=True, remove_unused_columns=False, seed=0)
    Trainer(model=model, args=args, train_dataset=rows, data_collator=WITCollator(tokenizer, 0.0, "plain",
                                                                                 int(MAX_LENGTH)),
            processing_class=tokenizer).train()
    return sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def bergson(out: Path, pool: Path, target: Path, preconditioner: str) -> Path:
    """bergson's (pool, target) scores, as an attribution file validate reads (one list per pool row)."""
    path = out / f"bergson_{preconditioner}.parquet"
    if path.exists():
        return path
    python = os.environ.get("BERGSON_PYTHON") or str(out / "bergson/.venv-bergson/bin/python")
    if not Path(python).exists():
        run("bash", str(REPO / "benchmarks/peers/bergson_env.sh"), str(out / "bergson"))
    from gradspec.data.models import default_model_path

    raw = out / f"bergson_{preconditioner}_raw.parquet"
    run(python, str(REPO / "benchmarks/peers/bergson_filtered.py"), "--filter-modules", "*.mlp.*,lm_head", "--model",
        str(default_model_path()), "--pool", str(pool), "--target", str(target), "--out", str(raw),
        "--preconditioner", preconditioner, "--loss-reduction", "mean", "--max-length", MAX_LENGTH,
        "--workdir", str(out / "bergson" / preconditioner))
    frame = pd.read_parquet(raw)
    frame = frame[frame["target_index"] != "mean"].astype({"target_index": int, "pool_index": int})
    table = frame.pivot(index="pool_index", columns="target_index", values="score").sort_index()
    pd.DataFrame({"index": table.index, "attribution": [list(map(float, r)) for r in table.to_numpy()]}) \
        .to_parquet(path)
    return path


def random_attribution(out: Path, pool: Path, target: Path) -> Path:
    path = out / "random.parquet"
    rows, targets = (len(p.read_text().splitlines()) for p in (pool, target))
    values = np.random.default_rng(0).standard_normal((rows, targets))
    pd.DataFrame({"index": range(rows), "attribution": list(values)}).to_parquet(path)
    return path


def kind(out: Path) -> Path:
    """The filter by kind that alignment must beat: 1 for the pool's gsm8k rows (the target's kind), else 0."""
    path = out / "kind.parquet"
    n_instruction, n_gsm8k, n_code, _ = SIZES
    values = [0.0] * n_instruction + [1.0] * n_gsm8k + [0.0] * n_code
    pd.DataFrame({"index": range(len(values)), "gsm8k": values}).to_parquet(path)
    return path


def validate(out: Path, pool: Path, target: Path, name: str, *extra: str) -> Path:
    path = out / f"{name}.parquet"
    if not path.exists():
        resume = ["--resume"] if Path(f"{path}.parts").exists() else []
        run(GRADSPEC, "validate", "--data", str(pool), "--target", str(target), "--out", str(path), *RECIPE,
            "--quiet", *resume, *extra)
    return path


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pool, target = build(out)
    plain = align(out, pool, target, "plain", "--spectra", "--classic")
    attributions = [plain, align(out, pool, target, "kfac", "--precondition", "kfac", "--factors",
                                 str(out / "kfac.safetensors")),
                    align(out, pool, target, "ekfac", "--precondition", "ekfac", "--factors",
                          str(out / "ekfac.safetensors"))]
    adam = [align(out, pool, target, f"adam_{c.name}", "--model", str(c), "--precondition", "adam",
                  "--optimizer-state", str(c)) for c in adam_checkpoints(out, pool)]
    if not (out / "adam.parquet").exists():
        sum_over_checkpoints(adam, out / "adam.parquet")
    lds = validate(out, pool, target, "lds", "--subsets", SUBSETS, "--fraction", "0.5")  # needs no score
    attributions += [out / "adam.parquet", *(bergson(out, pool, target, p) for p in ("kfac", "ekfac")),
                     random_attribution(out, pool, target)]
    per_sample = [f"{plain}:{column}" for column in PER_SAMPLE] + [f"{kind(out)}:gsm8k"]
    chosen = [f"{plain}:{column}" for column in ("nuclear_norm", "effective_rank", "ifd")] + [f"{kind(out)}:gsm8k"]
    selections = [*attributions[:4], out / "bergson_ekfac.parquet"]
    run(GRADSPEC, "validate", "--runs", str(lds), "--scores", *(str(p) for p in attributions), *per_sample,
        "--report", str(out / "report_lds"), "--overwrite")
    outcome = validate(out, pool, target, "outcome", "--subsets", "0", "--top", "0.25", "--seeds", SEEDS,
                       "--length-buckets", "0", "--outcome", *(str(p) for p in selections), *chosen)
    run(GRADSPEC, "validate", "--runs", str(outcome), "--report", str(out / "report_outcome"), "--overwrite")
    print(f"reports: {out / 'report_lds' / 'report.md'}, {out / 'report_outcome' / 'report.md'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/validate_findings"))
