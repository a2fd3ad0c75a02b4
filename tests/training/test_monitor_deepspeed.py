"""SpectralMonitorCallback under DeepSpeed ZeRO-2 and ZeRO-3 through transformers' Trainer: two gloo
processes on the CPU (torchrun), each rank's rows equal to one process's rows for the same micro-batch
(ZeRO-3 partitions every weight: its full shape is the parameter's ds_shape). Run as a script, this file
is the worker of one process, for each stage in turn."""

import sys
from pathlib import Path

import pandas as pd
import pytest
from test_monitor_fsdp import ONE_THREAD, assert_rows_equal, trainer_step

pytest.importorskip("deepspeed")

STAGES = (2, 3)


def zero(stage: int) -> dict:
    """Trainer's deepspeed argument for this ZeRO stage, SGD at Trainer's learning rate."""
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
            "zero_allow_untested_optimizer": True}


def test_zero_2_and_3_rows_equal_single_process_rows(tiny_model_dir, tmp_path):
    from conftest import one_thread, torchrun  # not at the top: run as a script, the file has no conftest

    with one_thread():
        trainer_step(str(tiny_model_dir), str(tmp_path / "single"), None, accumulation=2)
    torchrun(Path(__file__).resolve(), tiny_model_dir, tmp_path / "zero", env=ONE_THREAD)
    single = pd.read_parquet(tmp_path / "single" / "m.parquet")
    for stage in STAGES:
        for rank in range(2):  # rank r's micro-batch is the single process's r-th accumulated one
            rows = pd.read_parquet(tmp_path / "zero" / f"stage{stage}" / f"m.rank{rank}.parquet")
            assert_rows_equal(rows, single[single["micro_batch"] == rank].reset_index(drop=True),
                              f"ZeRO-{stage} rank {rank}")


if __name__ == "__main__":
    from accelerate.state import AcceleratorState

    for stage in STAGES:
        AcceleratorState._reset_state(False)  # each Trainer's own DeepSpeed plugin
        trainer_step(sys.argv[1], str(Path(sys.argv[2]) / f"stage{stage}"), None, accumulation=1,
                     deepspeed=zero(stage))
