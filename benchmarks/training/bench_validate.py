"""Overhead of `gradspec validate` over the retrains it runs: SmolLM2-135M-Instruct (fp32), a pool of 16
HumanEval rows and 4 others as the target, --max-length 256, 4 LDS subsets of half the pool (8 rows, 2
steps of 4 each, AdamW at 1e-4).

The floor (common.retrain_floor) is the work the test cannot avoid, in a bare loop: load the model,
tokenize, and per subset put the start weights back, train on its rows (gradspec's response loss,
AdamW, clipping, the linear decay: the same steps validate takes) and measure every target's loss.
validate adds the run folder (manifest, one part per retrain, the merge), the start losses, the plan
and its checks. Rounds
alternate between the rows so that both see the same load; each row's wall time and this process's CPU
time (steadier on a shared machine) are printed, with the ratio of each round. Run with
``pytest benchmarks/training/bench_validate.py -s``; BENCH_ROUNDS (default 2) sets the rounds.
"""

import json
import os
import shutil
import time

from benchmarks.common import interleaved_rounds, retrain_floor
from gradspec.data.readers import humaneval_samples
from gradspec.validation.config import ValidateConfig, ValidateSettings
from gradspec.validation.run import retrain

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 2))
POOL, TARGETS, SUBSETS, MAX_LENGTH, LR = 16, 4, 4, 256, 1e-4


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

    def floor() -> None:
        retrain_floor(pool_path, target_path, subsets=SUBSETS, max_length=MAX_LENGTH, learning_rate=LR)

    times = interleaved_rounds({"floor": timed("floor", floor),
                                "validate": timed("validate", lambda: validate(pool_path, target_path, out))},
                               ROUNDS, "validate: ")
    for label, table in (("wall", times), ("CPU", cpu)):
        best = {row: min(t) for row, t in table.items()}
        print(f"\n{label}: validate {best['validate']:.1f} s, floor {best['floor']:.1f} s (best of {ROUNDS}): "
              f"{best['validate'] / best['floor']:.3f}x; rounds: "
              + ", ".join(f"{a / b:.3f}x" for a, b in zip(table["validate"], table["floor"], strict=True)))
