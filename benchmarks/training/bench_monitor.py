"""Overhead of the live spectral monitor on a training step: SmolLM2-135M-Instruct (fp32), Trainer,
AdamW, batches of 4 HumanEval samples, 6 steps; monitor on every step (q/k/v/o, then all modules)
vs off. Run with ``pytest benchmarks/training/bench_monitor.py -s``; the ratios print at the end.
"""

import pytest

from benchmarks.common import MEDIANS
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.training.monitor_callback import SpectralMonitorCallback
from gradspec.training.wit import WITCollator

STEPS = 6
MODES = {"off": None, "attn": "attn", "all": "all"}


def _train(tmp_path, modules):
    from transformers import Trainer, TrainingArguments

    model, tokenizer = load_model()
    rows = [{"messages": s.messages} for s in humaneval_samples(4 * STEPS)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS,
                             learning_rate=1e-5, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_strategy="no", seed=0)
    callbacks = [] if modules is None else [SpectralMonitorCallback(every=1, modules=modules)]
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=WITCollator(tokenizer),
                      callbacks=callbacks)
    return trainer.train().metrics["train_runtime"] / STEPS


@pytest.mark.parametrize("mode", list(MODES))
def test_step_time(mode, tmp_path, benchmark):
    per_step = []  # Trainer's own runtime per step (model loading excluded); the best of two runs
    benchmark.pedantic(lambda: per_step.append(_train(tmp_path, MODES[mode])), rounds=2, iterations=1)
    MEDIANS[f"monitor-{mode}"] = min(per_step)


def test_report():
    if not {f"monitor-{m}" for m in MODES} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    off = MEDIANS["monitor-off"]
    for m in MODES:
        print(f"\nmonitor {m}: {MEDIANS[f'monitor-{m}']:.2f} s/step, {MEDIANS[f'monitor-{m}'] / off:.2f}x")
