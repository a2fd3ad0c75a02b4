"""SpectralMonitor under DDP: two gloo processes on the CPU (torchrun) give the rows one process gives.

Trainer multiplies a loss over the global token count by the number of processes; without the
monitor dividing that back out, every nuclear norm here would come out twice as large. Run as a
script, this file is the training worker of one process.
"""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
]
LOSSES = {"ntp": None, "wit": (0.5, 1.0)}
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}  # as torchrun sets per worker


def train(model_dir: str, out: str, accumulation: int) -> None:
    """One optimizer step over the 4 rows in micro-batches of 2, in order, learning rate 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from gradspec.training.monitor_callback import SpectralMonitorCallback
    from gradspec.training.wit import WITCollator, WITLoss, use_wit_loss

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name, weights in LOSSES.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        if weights is not None:
            use_wit_loss(model, WITLoss(*weights))
        args = TrainingArguments(
            output_dir=str(Path(out) / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
            max_steps=1, learning_rate=0.0, remove_unused_columns=False, report_to=[], save_strategy="no",
            use_cpu=True, logging_strategy="no", train_sampling_strategy="sequential")
        out_file = Path(out) / f"{name}.parquet"  # one path, as a user gives it: each rank writes its own file
        monitor = SpectralMonitorCallback(every=1, modules="all", out=out_file)
        collator = WITCollator(tokenizer, prompt_weight=0.0 if weights is None else weights[0])
        Trainer(model=model, args=args, train_dataset=ROWS, data_collator=collator, callbacks=[monitor]).train()


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _rows(folder: Path, loss: str) -> pd.DataFrame:
    rows = pd.concat([pd.read_parquet(p) for p in sorted(folder.glob(f"{loss}*.parquet"))])
    return rows.set_index("num_tokens").sort_index()  # the rows' lengths are distinct


def test_ddp_rows_equal_single_process_rows(tiny_model_dir, tmp_path):
    """Rank r's micro-batch is the single process's r-th accumulated micro-batch (same rows,
    same padding), so the rows must agree to rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each torchrun worker
    try:
        train(str(tiny_model_dir), str(tmp_path / "single"), accumulation=2)
    finally:
        torch.set_num_threads(threads)
    script = str(Path(__file__).resolve())
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
          str(tiny_model_dir), str(tmp_path / "ddp"), "1"])
    for loss in LOSSES:
        single, ddp = _rows(tmp_path / "single", loss), _rows(tmp_path / "ddp", loss)
        assert len(single) == 4 and list(ddp.index) == list(single.index)
        assert sorted(p.name for p in (tmp_path / "ddp").glob(f"{loss}*")) == [f"{loss}.rank0.parquet",
                                                                              f"{loss}.rank1.parquet"]  # no parts left
        assert (single["status"] == "ok").all() and (ddp["status"] == "ok").all()
        assert ddp["loss"].tolist() == single["loss"].tolist()
        metrics = [c for c in single.columns if "/" in c]
        assert len(metrics) > 0
        for column in metrics:
            assert ddp[column].tolist() == pytest.approx(single[column].tolist(), rel=1e-6), column


if __name__ == "__main__":
    train(*sys.argv[1:3], int(sys.argv[3]))
