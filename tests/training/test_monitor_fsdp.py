"""SpectralMonitor in an FSDP2 training loop: two gloo processes on the CPU (torchrun), the model's
weights sharded (fully_shard per decoder layer, then the root), each rank's rows equal to one
process's rows for the same micro-batch. Run as a script, this file is the worker of one process.
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
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}


def step(model_dir: str, out: str, rank: int, world: int, sharded: bool) -> None:
    """One monitored step of a plain loop over this rank's 2 rows (all 4 in one process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradspec.training.monitor import SpectralMonitor
    from gradspec.training.wit import WITCollator

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = SpectralMonitor(every=1, modules="all", out=Path(out) / "m.parquet")  # m.rank<r>.parquet per rank
    mine = ROWS[rank * len(ROWS) // world : (rank + 1) * len(ROWS) // world]
    for i in range(0, len(mine), 2):  # micro-batches of 2: each rank's one is the single process's i-th
        batch = WITCollator(tokenizer)(mine[i : i + 2])
        with monitor.step(model, step=1 + i // 2):
            model(**batch).loss.backward()
        optimizer.step()
    monitor.close()  # the parts into m.parquet (m.rank<r>.parquet)


def test_fsdp2_rows_equal_single_process_rows(tiny_model_dir, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step(str(tiny_model_dir), str(tmp_path / "single"), 0, 1, sharded=False)
    finally:
        torch.set_num_threads(threads)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).resolve()), str(tiny_model_dir), str(tmp_path / "fsdp")],
                          env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = pd.read_parquet(tmp_path / "single" / "m.parquet")
    ranks = [pd.read_parquet(tmp_path / "fsdp" / f"m.rank{r}.parquet") for r in range(2)]
    for rank, rows in enumerate(ranks):  # rank r's micro-batch is the single process's step r + 1
        want = single[single["step"] == rank + 1].reset_index(drop=True)
        assert len(rows) == 2 and (rows["status"] == "ok").all() and rows["num_tokens"].tolist() == \
            want["num_tokens"].tolist()
        assert rows["loss"].tolist() == pytest.approx(want["loss"].tolist(), rel=1e-6)
        metrics = [c for c in want.columns if "/" in c]
        assert len(metrics) > 0
        for column in metrics:
            assert rows[column].tolist() == pytest.approx(want[column].tolist(), rel=1e-6), column


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        step(sys.argv[1], sys.argv[2], dist.get_rank(), dist.get_world_size(), sharded=True)
    finally:
        dist.destroy_process_group()
