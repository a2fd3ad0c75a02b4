"""DynamicsCallback under torchrun: two gloo processes on the CPU each measure half the samples, and one
file results, equal to one process's. Run as a script, this file is the training worker of one process."""

import json
import sys
from pathlib import Path

import pandas as pd

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
    {"instruction": "Count to three.", "output": "One, two, three."},
]


def train(model_dir: str, out: str) -> None:
    """Two epochs over the rows, learning rate 0: every epoch measures the same model."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from gradspec.data.readers import to_sample
    from gradspec.training import dynamics
    from gradspec.training.wit import WITCollator

    measured = []
    real = dynamics.measure
    dynamics.measure = lambda model, tokenizer, samples, *a: measured.append(len(samples)) or real(
        model, tokenizer, samples, *a)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = [to_sample(i, f"row {i}", row) for i, row in enumerate(ROWS)]
    args = TrainingArguments(output_dir=str(Path(out) / "run"), per_device_train_batch_size=1, num_train_epochs=2,
                             learning_rate=0.0, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_strategy="no")
    callback = dynamics.DynamicsCallback(tokenizer, samples, Path(out) / "dynamics.parquet")
    Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=ROWS,
            data_collator=WITCollator(tokenizer), callbacks=[callback]).train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    (Path(out) / f"measured.{rank}.json").write_text(json.dumps(measured))


def test_each_rank_measures_its_share_and_one_file_results(tiny_model_dir, tmp_path):
    from conftest import one_thread, torchrun  # not at the top: run as a script, the file has no conftest

    with one_thread():
        train(str(tiny_model_dir), str(tmp_path / "single"))
    torchrun(Path(__file__).resolve(), tiny_model_dir, tmp_path / "ddp")
    assert json.loads((tmp_path / "single" / "measured.0.json").read_text()) == [5, 5]
    assert [json.loads((tmp_path / "ddp" / f"measured.{r}.json").read_text()) for r in (0, 1)] == [[3, 3], [2, 2]]
    assert sorted(p.name for p in (tmp_path / "ddp").glob("*.parquet")) == ["dynamics.parquet"]
    single, ddp = pd.read_parquet(tmp_path / "single" / "dynamics.parquet"), pd.read_parquet(
        tmp_path / "ddp" / "dynamics.parquet")
    assert ddp["index"].tolist() == single["index"].tolist() == [0, 1, 2, 3, 4]
    pd.testing.assert_frame_equal(ddp, single, rtol=1e-6)


if __name__ == "__main__":
    train(*sys.argv[1:3])
