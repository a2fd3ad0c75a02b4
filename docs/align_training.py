"""Does alignment pick training data that helps the task? Pick 100 of about 1,000 pool samples by
exact alignment with 20 gsm8k reasoning traces (align_mean), at random, and by effective rank (the
spectra alone); fine-tune SmolLM2-135M-Instruct briefly on each pick with `gradspec train`; compare
the mean response loss on 30 held-out gsm8k traces, before and after.

Pool: 600 instruction samples (WizardLM, OpenHermes, Magpie: the reward and IFD subsets, high and
low), 100 gsm8k R1 traces and 100 HumanEval problems, 200 more instruction samples from the
difficulty subsets: 1,000 in all. max_length 256, plain template, q/k/v/o.

    .venv/bin/python docs/align_training.py [OUT]     # 94 minutes on 2 CPU cores (shared with other jobs)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from pools import gsm8k_samples, instruction_samples, write_jsonl

import gradspec
from gradspec.data.batching import Item
from gradspec.data.models import load_model
from gradspec.data.readers import Fields, humaneval_samples, read_samples
from gradspec.data.templates import tokenize
from gradspec.engine.loss import item_losses
from gradspec.runs.score_files import module_mean

MAX_LENGTH, PICK = 256, 100


def rows(samples):
    return [{"messages": s.messages} for s in samples]


def build(out: Path) -> tuple[Path, Path, Path]:
    instruction, gsm8k = instruction_samples(45), gsm8k_samples()
    pool = instruction[:800] + gsm8k[:100] + list(humaneval_samples(100))
    return (write_jsonl(out / "pool.jsonl", rows(pool)), write_jsonl(out / "task.jsonl", rows(gsm8k[100:120])),
            write_jsonl(out / "heldout.jsonl", rows(gsm8k[120:150])))


def heldout_loss(model_path: str | None, heldout: Path) -> float:
    model, tok = load_model(model_path)
    items = [Item(s, tokenize(s.messages, tok, "plain", MAX_LENGTH)) for s in read_samples(heldout, Fields())]
    return float(np.mean([loss for _, loss, _ in item_losses(model, tok, items)]))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pool, task, heldout = build(out)
    scores = gradspec.align(pool, task, out=out / "aligned.parquet", spectra=True, max_length=MAX_LENGTH,
                            overwrite=True, progress=False)
    ok = scores[scores["status"] == "ok"]
    picks = {
        "alignment": ok.nlargest(PICK, "align_mean")["index"],
        "random": ok.sample(PICK, random_state=0)["index"],
        "effective rank": ok.assign(er=module_mean(ok, "effective_rank")).nlargest(PICK, "er")["index"],
    }
    records = [json.loads(line) for line in pool.read_text().splitlines()]
    results = {"before training": heldout_loss(None, heldout)}
    kinds = {}
    for name, index in picks.items():
        data = write_jsonl(out / f"pick_{name.replace(' ', '_')}.jsonl", [records[i] for i in index])
        kinds[name] = pd.Series(index.map(lambda i: "gsm8k" if 800 <= i < 900 else "code" if i >= 900
                                          else "instruction")).value_counts().to_dict()
        run = out / f"train_{name.replace(' ', '_')}"
        subprocess.run([str(Path(sys.executable).parent / "gradspec"), "train", "--data", str(data), "--out", str(run),
                        "--max-length", str(MAX_LENGTH), "--epochs", "1", "--batch-size", "4",
                        "--learning-rate", "1e-4", "--seed", "0"], check=True)
        results[name] = heldout_loss(str(run / "model"), heldout)
    lines = ["| training data (100 samples) | kinds picked | held-out gsm8k loss |", "|---|---|---:|"]
    for name, loss in results.items():
        lines.append(f"| {name} | {kinds.get(name, '')} | {loss:.4f} |")
    print("\n".join(lines))
    (out / "training.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/align_training"))
