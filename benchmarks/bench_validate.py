"""Overhead of `gradspec validate` over the retrains it runs: SmolLM2-135M-Instruct (fp32), a pool of 16
HumanEval rows and 4 others as the target, --max-length 256, 4 LDS subsets of half the pool (8 rows, 2
steps of 4 each, AdamW at 1e-4).

The floor is the work the test cannot avoid, in a bare loop: load the model, tokenize, and per subset
put the start weights back, train on its rows (gradspec's response loss, AdamW, clipping, the linear
decay: the same steps validate takes) and measure every target's loss. validate adds the run folder
(manifest, one part per retrain, the merge), the start losses, the plan and its checks. Rounds
alternate between the rows so that both see the same load; each row's wall time and this process's CPU
time (steadier on a shared machine) are printed, with the ratio of each round. Run with
``pytest benchmarks/bench_validate.py -s``; BENCH_ROUNDS (default 2) sets the rounds.
"""

import json
import os
import shutil
import time

import torch
from conftest import interleaved_rounds

from gradspec.data.batching import Item, pad_batch, pad_id_of
from gradspec.data.models import load_model
from gradspec.data.readers import Fields, humaneval_samples, read_samples
from gradspec.data.templates import tokenize
from gradspec.engine.loss import item_losses, response_losses
from gradspec.validation.config import ValidateConfig, ValidateSettings
from gradspec.validation.retrain import MAX_GRAD_NORM, Recipe, batches
from gradspec.validation.run import retrain
from gradspec.validation.subsets import lds_subset

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 2))
POOL, TARGETS, SUBSETS, MAX_LENGTH, LR = 16, 4, 4, 256, 1e-4


def floor(pool_path, target_path) -> None:
    """The retrains and target losses alone, as a user's own script would run them."""
    model, tokenizer = load_model(progress=False)
    tokens = {path: [(s, tokenize(s.messages, tokenizer, "plain", MAX_LENGTH)) for s in read_samples(path, Fields())]
              for path in (pool_path, target_path)}
    rows = {s.index: t for s, t in tokens[pool_path]}
    targets = [Item(s, t) for s, t in tokens[target_path]]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    recipe, pad_id = Recipe(batch_size=4, learning_rate=LR), pad_id_of(tokenizer)
    for k in range(SUBSETS):
        members = lds_subset(sorted(rows), 0.5, 0, k)
        model.load_state_dict(start)
        steps = batches(members, recipe, 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s, n=len(steps): 1 - s / n)  # noqa: B008
        model.train()
        for batch in steps:
            loss = response_losses(model, *pad_batch([rows[i] for i in batch], pad_id, "cpu"))[0].mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        [loss for _, loss, _ in item_losses(model, tokenizer, targets)]


def validate(pool_path, target_path, out) -> None:
    shutil.rmtree(out.parent, ignore_errors=True)
    out.parent.mkdir()
    config = ValidateConfig(data=str(pool_path), target=str(target_path), max_length=MAX_LENGTH, subsets=SUBSETS,
                            fraction=0.5, batch_size=4, learning_rate=LR)
    assert retrain(config, ValidateSettings(out=str(out), progress=False)) == SUBSETS


def test_validate_overhead(tmp_path):
    samples = list(humaneval_samples(POOL + TARGETS))
    pool_path, target_path = tmp_path / "pool.jsonl", tmp_path / "target.jsonl"
    for path, part in ((pool_path, samples[:POOL]), (target_path, samples[POOL:])):
        path.write_text("".join(json.dumps({"messages": s.messages}) + "\n" for s in part))
    out = tmp_path / "run" / "validate.parquet"
    cpu: dict[str, list[float]] = {"floor": [], "validate": []}  # this process's CPU seconds: steadier under load

    def timed(row, fn):
        def run():
            began = time.process_time()
            fn()
            cpu[row].append(time.process_time() - began)
        return run

    times = interleaved_rounds({"floor": timed("floor", lambda: floor(pool_path, target_path)),
                                "validate": timed("validate", lambda: validate(pool_path, target_path, out))},
                               ROUNDS, "validate: ")
    for label, table in (("wall", times), ("CPU", cpu)):
        best = {row: min(t) for row, t in table.items()}
        print(f"\n{label}: validate {best['validate']:.1f} s, floor {best['floor']:.1f} s (best of {ROUNDS}): "
              f"{best['validate'] / best['floor']:.3f}x; rounds: "
              + ", ".join(f"{a / b:.3f}x" for a, b in zip(table["validate"], table["floor"], strict=True)))
