"""SpectralMonitorCallback under DeepSpeed ZeRO-2 and ZeRO-3 through transformers' Trainer: two gloo
processes on the CPU (torchrun), each rank's rows equal to one process's rows for the same micro-batch
(ZeRO-3 partitions every weight: its full shape is the parameter's ds_shape). Run as a script, this file
is the worker of one process, for each stage in turn."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("deepspeed")

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
STAGES = (2, 3)


def trainer_step(model_dir: str, out: str, stage: int | None, accumulation: int) -> None:
    """One monitored optimizer step of Trainer over the 4 rows in micro-batches of 2, in order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from gradspec.training.monitor_callback import SpectralMonitorCallback
    from gradspec.training.wit import WITCollator

    zero = {} if stage is None else {"deepspeed": {
        "zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
        "zero_allow_untested_optimizer": True}}
    args = TrainingArguments(output_dir=str(Path(out) / "run"), per_device_train_batch_size=2, max_steps=1,
                             gradient_accumulation_steps=accumulation, learning_rate=0.0, remove_unused_columns=False,
                             report_to=[], save_strategy="no", use_cpu=True, logging_strategy="no",
                             train_sampling_strategy="sequential", **zero)
    monitor = SpectralMonitorCallback(every=1, modules="all", out=Path(out) / "m.parquet")
    Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=ROWS,
            data_collator=WITCollator(AutoTokenizer.from_pretrained(model_dir)), callbacks=[monitor]).train()


def test_zero_2_and_3_rows_equal_single_process_rows(tiny_model_dir, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer_step(str(tiny_model_dir), str(tmp_path / "single"), None, accumulation=2)
    finally:
        torch.set_num_threads(threads)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).resolve()), str(tiny_model_dir), str(tmp_path / "zero")],
                          env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = pd.read_parquet(tmp_path / "single" / "m.parquet")
    for stage in STAGES:
        for rank in range(2):  # rank r's micro-batch is the single process's r-th accumulated one
            rows = pd.read_parquet(tmp_path / "zero" / f"stage{stage}" / f"m.rank{rank}.parquet")
            want = single[single["micro_batch"] == rank].reset_index(drop=True)
            assert len(rows) == 2 and (rows["status"] == "ok").all(), (stage, rank)
            assert rows["num_tokens"].tolist() == want["num_tokens"].tolist()
            assert rows["loss"].tolist() == pytest.approx(want["loss"].tolist(), rel=1e-6)
            metrics = [c for c in want.columns if "/" in c]
            assert len(metrics) > 0
            for column in metrics:
                assert rows[column].tolist() == pytest.approx(want[column].tolist(), rel=1e-6), (stage, rank, column)


if __name__ == "__main__":
    from accelerate.state import AcceleratorState

    for stage in STAGES:
        AcceleratorState._reset_state(False)  # each Trainer's own DeepSpeed plugin
        trainer_step(sys.argv[1], str(Path(sys.argv[2]) / f"stage{stage}"), stage, accumulation=1)
