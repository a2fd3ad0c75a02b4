"""The monitor's per-role means reach what report_to names: Trainer calls its trackers' callbacks before a
user's, so the means join the log record inside Trainer's log, before any callback sees it. Tested with
TensorBoard's writer and trackio, on the CPU."""

import json
import sqlite3

import pytest
from conftest import tiny_model

from gradspec.training.monitor_callback import SpectralMonitorCallback
from gradspec.training.wit import WITCollator

ROWS = [{"instruction": "Name a colour.", "output": "Blue."}, {"instruction": "Hi", "output": "Hello there."}]
MEANS = {f"spectra/{role}/{metric}" for role in "qkvo" for metric in ("nuclear_norm", "effective_rank")}


def test_the_per_role_means_reach_tensorboard_and_trackio(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read where trackio is imported
    pytest.importorskip("tensorboard")
    trackio = pytest.importorskip("trackio")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import Trainer, TrainingArguments

    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")  # imported before the env
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                             learning_rate=0.0, remove_unused_columns=False, report_to=["tensorboard", "trackio"],
                             save_strategy="no", use_cpu=True, logging_steps=1, project="gradspec-test")
    Trainer(model=tiny_model("llama"), args=args, train_dataset=ROWS, data_collator=WITCollator(tokenizer),
            callbacks=[SpectralMonitorCallback(every=2)]).train()
    events = EventAccumulator(str(next((tmp_path / "run").glob("runs/*/events.out.tfevents.*"))))
    events.Reload()
    assert {f"train/{m}" for m in MEANS} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/spectra/q/effective_rank")] == [2]  # the monitored step only
    with sqlite3.connect(trackio.sqlite_storage.SQLiteStorage.get_project_db_path("gradspec-test")) as db:
        logged = [json.loads(m) for (m,) in db.execute("select metrics from metrics order by step")]
    assert [MEANS <= {k.removeprefix("train/") for k in m} for m in logged[:2]] == [False, True]
