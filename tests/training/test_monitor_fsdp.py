"""SpectralMonitor in an FSDP training loop: two gloo processes on the CPU (torchrun), the model's
weights sharded per decoder layer, then the root (FSDP2's fully_shard; FSDP1 with use_orig_params false
and true, which leaves a flat shard of each weight on its module outside the forward), each rank's rows
equal to one process's rows for the same micro-batch. Run as a script, this file is the worker of one
process, for every kind of sharding in turn.
"""

import os
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
SHARDINGS = ("fsdp2", "fsdp1", "fsdp1_orig_params")


def step(model_dir: str, out: str, rank: int, world: int, sharded: str | None) -> None:
    """One monitored step of a plain loop over this rank's 2 rows (all 4 in one process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradspec.training.monitor import SpectralMonitor
    from gradspec.training.wit import WITCollator

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    if sharded == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif sharded is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                                         use_orig_params=sharded == "fsdp1_orig_params", device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = SpectralMonitor(every=1, modules="all", out=Path(out) / "m.parquet")  # m.rank<r>.parquet per rank
    mine = ROWS[rank * len(ROWS) // world : (rank + 1) * len(ROWS) // world]
    for i in range(0, len(mine), 2):  # micro-batches of 2: each rank's one is the single process's i-th
        batch = WITCollator(tokenizer)(mine[i : i + 2])
        with monitor.step(model, step=1 + i // 2):
            model(**batch).loss.backward()
        optimizer.step()
    monitor.close()  # the parts into m.parquet (m.rank<r>.parquet)


# FSDP through transformers' Trainer (accelerate's plugin); FSDP1 on the CPU cannot sync module states at wrap time
TRAINER_FSDP = {"fsdp2": {"version": 2},
                "fsdp1": {"version": 1, "use_orig_params": False, "sync_module_states": False},
                "fsdp1_orig_params": {"version": 1, "use_orig_params": True, "sync_module_states": False}}


def trainer_step(model_dir: str, out: str, fsdp: dict | None, accumulation: int, **sharding) -> None:
    """One monitored optimizer step of Trainer over the 4 rows in micro-batches of 2, in order; fsdp: the
    FSDP config (accelerate's plugin), or sharding: other TrainingArguments (DeepSpeed's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from gradspec.training.monitor_callback import SpectralMonitorCallback
    from gradspec.training.wit import WITCollator

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if fsdp is not None:
        sharding = {"fsdp": "full_shard auto_wrap", "fsdp_config": {
            "transformer_layer_cls_to_wrap": [type(model.model.layers[0]).__name__], **fsdp}}
    args = TrainingArguments(output_dir=str(Path(out) / "run"), per_device_train_batch_size=2, max_steps=1,
                             gradient_accumulation_steps=accumulation, learning_rate=0.0, remove_unused_columns=False,
                             report_to=[], save_strategy="no", use_cpu=True, logging_strategy="no",
                             train_sampling_strategy="sequential", **sharding)
    monitor = SpectralMonitorCallback(every=1, modules="all", out=Path(out) / "m.parquet")
    Trainer(model=model, args=args, train_dataset=ROWS, data_collator=WITCollator(AutoTokenizer.from_pretrained(
        model_dir)), callbacks=[monitor]).train()


def assert_rows_equal(rows: pd.DataFrame, want: pd.DataFrame, what: str) -> None:
    assert len(rows) == 2 and (rows["status"] == "ok").all(), what
    assert rows["num_tokens"].tolist() == want["num_tokens"].tolist(), what
    assert rows["loss"].tolist() == pytest.approx(want["loss"].tolist(), rel=1e-6), what
    metrics = [c for c in want.columns if "/" in c]
    assert len(metrics) > 0
    for column in metrics:
        assert rows[column].tolist() == pytest.approx(want[column].tolist(), rel=1e-6), (what, column)


def test_fsdp_through_trainer_rows_equal_single_process_rows(tiny_model_dir, tmp_path):
    """accelerate's FSDP2, FSDP1 and FSDP1 with use_orig_params under Trainer: rank r's micro-batch is the
    single process's r-th accumulated one, and its rows that micro-batch's rows."""
    from conftest import one_thread, torchrun  # not at the top: run as a script, the file has no conftest

    with one_thread():
        trainer_step(str(tiny_model_dir), str(tmp_path / "single"), None, accumulation=2)
    torchrun(Path(__file__).resolve(), tiny_model_dir, tmp_path / "fsdp", "trainer", env=ONE_THREAD)
    single = pd.read_parquet(tmp_path / "single" / "m.parquet")
    for sharding in TRAINER_FSDP:
        for rank in range(2):
            rows = pd.read_parquet(tmp_path / "fsdp" / sharding / f"m.rank{rank}.parquet")
            want = single[single["micro_batch"] == rank].reset_index(drop=True)
            assert_rows_equal(rows, want, f"{sharding} rank {rank}")


def test_fsdp_rows_equal_single_process_rows(tiny_model_dir, tmp_path):
    from conftest import one_thread, torchrun  # not at the top: run as a script, the file has no conftest

    with one_thread():
        step(str(tiny_model_dir), str(tmp_path / "single"), 0, 1, sharded=None)
    torchrun(Path(__file__).resolve(), tiny_model_dir, tmp_path / "fsdp", env=ONE_THREAD)
    single = pd.read_parquet(tmp_path / "single" / "m.parquet")
    ranks = [(sharding, rank, pd.read_parquet(tmp_path / "fsdp" / sharding / f"m.rank{rank}.parquet"))
             for sharding in SHARDINGS for rank in range(2)]
    for sharding, rank, rows in ranks:  # rank r's micro-batch is the single process's step r + 1
        assert_rows_equal(rows, single[single["step"] == rank + 1].reset_index(drop=True), f"{sharding} rank {rank}")


if __name__ == "__main__" and sys.argv[3:] == ["trainer"]:
    from accelerate.state import AcceleratorState

    for sharding, fsdp in TRAINER_FSDP.items():
        AcceleratorState._reset_state(False)  # each Trainer's own FSDP plugin
        trainer_step(sys.argv[1], str(Path(sys.argv[2]) / sharding), fsdp, accumulation=1)
elif __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        for sharding in SHARDINGS:
            step(sys.argv[1], str(Path(sys.argv[2]) / sharding), dist.get_rank(), dist.get_world_size(), sharding)
    finally:
        dist.destroy_process_group()
