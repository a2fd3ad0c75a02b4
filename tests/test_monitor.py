import pandas as pd
import pytest
from conftest import tiny_model

from gradspec.engine import SpectralEngine
from gradspec.metrics import METRICS
from gradspec.monitor import SpectralMonitor
from gradspec.wit import WITCollator, WITLoss, use_wit_loss

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
]


def _train(model, tokenizer, tmp_path, monitor, accumulation=1, wit=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4 // accumulation,
                             gradient_accumulation_steps=accumulation, max_steps=2, learning_rate=0.0,
                             remove_unused_columns=False, report_to=[], save_strategy="no", use_cpu=True,
                             logging_steps=1)
    collator = WITCollator(tokenizer, prompt_weight=0.0 if wit is None else wit.prompt_weight)
    if wit is not None:
        use_wit_loss(model, wit)
    trainer = Trainer(model=model, args=args, train_dataset=ROWS, data_collator=collator, callbacks=[monitor])
    trainer.train()
    return trainer


@pytest.mark.parametrize("accumulation", [1, 2])
def test_monitor_rows_equal_gradspec_score_on_the_same_batch(tokenizer, tmp_path, accumulation):
    """Learning rate 0 keeps the weights, so every step's batch can be scored afterwards."""
    model = tiny_model("llama")
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "monitor.parquet")
    trainer = _train(model, tokenizer, tmp_path, monitor, accumulation)
    rows = pd.read_parquet(tmp_path / "monitor.parquet")
    assert rows["step"].tolist() == [1] * 4 + [2] * 4 and rows["scaled"].all()
    batch = WITCollator(tokenizer)(ROWS)
    want = SpectralEngine(tiny_model("llama"), "all").score(batch["input_ids"], batch["attention_mask"],
                                                             batch["labels"])
    lengths = batch["attention_mask"].sum(1).tolist()
    for _, row in rows.iterrows():
        i = lengths.index(row["num_tokens"])  # the rows' lengths are distinct
        for name, values in want.metrics.items():
            for k, metric in enumerate(METRICS):
                assert row[f"{name}/{metric}"] == pytest.approx(float(values[i, k]), rel=1e-4)
    logged = [h for h in trainer.state.log_history if "spectra/q/effective_rank" in h]
    assert len(logged) == 2


def test_monitor_with_wit_and_every_n(tokenizer, tmp_path):
    model = tiny_model("llama")
    monitor = SpectralMonitor(every=2, out=tmp_path / "m.parquet")
    _train(model, tokenizer, tmp_path, monitor, wit=WITLoss(0.5, 1.0))
    rows = pd.read_parquet(tmp_path / "m.parquet")
    assert rows["step"].unique().tolist() == [1] and rows["scaled"].all()
    assert (rows["status"] == "ok").all()
