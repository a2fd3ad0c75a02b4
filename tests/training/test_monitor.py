import re

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg.metrics import METRICS, metrics_from_singular_values
from gradspec.training.monitor import SpectralMonitor
from gradspec.training.wit import WITCollator, WITLoss, use_wit_loss, wit_loss

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
]


def _train(model, tokenizer, tmp_path, monitor, accumulation=1, wit=None, collate=None, **args):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4 // accumulation,
                             gradient_accumulation_steps=accumulation, max_steps=2, learning_rate=0.0,
                             remove_unused_columns=False, report_to=[], save_strategy="no", use_cpu=True,
                             logging_steps=1, **args)
    collator = WITCollator(tokenizer, prompt_weight=0.0 if wit is None else wit.prompt_weight)
    if wit is not None:
        use_wit_loss(model, wit)
    trainer = Trainer(model=model, args=args, train_dataset=ROWS, callbacks=[monitor],
                      data_collator=collator if collate is None else lambda rows: collate(collator(rows)))
    trainer.train()
    return trainer


def _modules(rows: pd.DataFrame) -> list[str]:
    return sorted({c.rsplit("/", 1)[0] for c in rows.columns if c.endswith("/nuclear_norm")})


def _assert_rows_equal(rows: pd.DataFrame, batch: dict, want: dict[int, dict[str, torch.Tensor]], rel: float):
    """Each row against the wanted metrics of the batch sample of its length (the lengths are distinct)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    checked = 0
    for _, row in rows.iterrows():
        i = lengths.index(row["num_tokens"])
        for name, values in want[i].items():
            for k, metric in enumerate(METRICS):
                assert row[f"{name}/{metric}"] == pytest.approx(float(values[k]), rel=rel), (i, name, metric)
                checked += 1
    assert checked > 0


SETUPS = {  # accumulation steps, WIT loss, whether the model takes loss kwargs (num_items_in_batch)
    "ntp": (1, None, True),
    "ntp, accumulated": (2, None, True),
    "wit at lp=0": (1, WITLoss(0.0, 1.0), True),
    "ntp, accumulated, no loss kwargs": (2, None, False),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_monitor_rows_equal_gradspec_score_on_the_same_batch(tokenizer, tmp_path, setup):
    """Learning rate 0 keeps the weights, so every step's batch can be scored afterwards. Without
    loss kwargs the model's loss is its micro-batch's mean, which Trainer divides by the
    accumulation steps."""
    accumulation, wit, loss_kwargs = SETUPS[setup]
    model = tiny_model("llama")
    if not loss_kwargs:
        model.accepts_loss_kwargs = False
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "monitor.parquet")
    trainer = _train(model, tokenizer, tmp_path, monitor, accumulation, wit)
    rows = pd.read_parquet(tmp_path / "monitor.parquet")
    assert rows["step"].tolist() == [1] * 4 + [2] * 4 and rows["scaled"].all()
    assert set(rows["loss"]) == {"ntp" if wit is None else "wit(lp=0,lr=1)"}
    assert (rows["num_loss_tokens"] == rows["num_response_tokens"]).all()
    batch = WITCollator(tokenizer)(ROWS)
    want = SpectralEngine(tiny_model("llama"), "all").score(batch["input_ids"], batch["attention_mask"],
                                                             batch["labels"])
    _assert_rows_equal(rows, batch, {i: {n: v[i] for n, v in want.metrics.items()} for i in range(4)}, 1e-4)
    logged = [h for h in trainer.state.log_history if "spectra/q/effective_rank" in h]
    assert len(logged) == 2


def _own_wit_metrics(model, batch: dict, i: int, wit: WITLoss, modules: list[str]) -> dict[str, torch.Tensor]:
    """Sample i alone, with WIT's denominator of that sample: each module's weight gradient by
    autograd, its metrics from a full SVD."""
    n = int(batch["attention_mask"][i].sum())
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"][i : i + 1, :n]).logits
    wit_loss(logits, batch["labels"][i : i + 1, :n], wit.prompt_weight, wit.response_weight).backward()
    return {name: metrics_from_singular_values(torch.linalg.svdvals(model.get_submodule(name).weight.grad.double()))
            for name in modules}


@pytest.mark.parametrize("weights", [(0.5, 1.0), (0.3, 0.8)])
def test_monitor_rows_under_wit_are_each_samples_own_wit_gradient(tokenizer, tmp_path, weights):
    """With prompt weight, a row is the spectrum of the gradient of WIT on the sample alone:
    (lp * its prompt NLL + lr * its response NLL) / (|P_i| + |R_i|), prompt terms included."""
    wit = WITLoss(*weights)
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "monitor.parquet")
    _train(tiny_model("llama"), tokenizer, tmp_path, monitor, wit=wit)
    rows = pd.read_parquet(tmp_path / "monitor.parquet")
    assert len(rows) == 8 and (rows["status"] == "ok").all() and rows["scaled"].all()
    assert set(rows["loss"]) == {f"wit(lp={weights[0]:g},lr={weights[1]:g})"}
    batch = WITCollator(tokenizer, prompt_weight=wit.prompt_weight)(ROWS)
    target = batch["labels"][:, 1:]
    own = ((target != -100).sum(1)).tolist()  # |P_i| + |R_i|, both weights being nonzero
    assert sorted(set(rows["num_loss_tokens"])) == sorted(own)
    assert (rows["num_loss_tokens"] > rows["num_response_tokens"]).all()  # prompt targets are counted
    model = tiny_model("llama")
    want = {i: _own_wit_metrics(model, batch, i, wit, _modules(rows)) for i in range(4)}
    _assert_rows_equal(rows, batch, want, 1e-4)


def test_monitor_every_n_steps(tokenizer, tmp_path):
    monitor = SpectralMonitor(every=2, out=tmp_path / "m.parquet")
    _train(tiny_model("llama"), tokenizer, tmp_path, monitor, wit=WITLoss(0.5, 1.0))
    rows = pd.read_parquet(tmp_path / "m.parquet")
    assert rows["step"].unique().tolist() == [1] and rows["scaled"].all()
    assert (rows["status"] == "ok").all()


def _left_padded(batch: dict) -> dict:
    """Each row's padding moved to its start."""
    lengths = batch["attention_mask"].sum(1)
    shifts = (batch["attention_mask"].shape[1] - lengths).tolist()
    return {k: torch.stack([row.roll(s) for row, s in zip(v, shifts, strict=True)]) for k, v in batch.items()}


def _packed(batch: dict) -> dict:
    """Every sample in one row, position ids restarting at each (a padding-free batch)."""
    real = batch["attention_mask"].bool()
    lengths = real.sum(1).tolist()
    return {"input_ids": batch["input_ids"][real][None], "labels": batch["labels"][real][None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}


def _flash_packed(batch: dict) -> dict:
    """Packed with flash-attention's sequence boundaries, as DataCollatorWithFlattening gives them."""
    packed = _packed(batch)
    bounds = torch.tensor([0, *batch["attention_mask"].sum(1).cumsum(0).tolist()], dtype=torch.int32)
    return {**packed, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}


@pytest.mark.parametrize(("collate", "message"), [
    (_left_padded, "left-padded"),
    (_packed, "packed batches \\(position_ids restarting within a row\\)"),
    (_flash_packed, "packed batches \\(cu_seq_lens_q, cu_seq_lens_k, position_ids restarting"),
])
def test_monitor_refuses_left_padded_and_packed_batches(tokenizer, tmp_path, collate, message):
    monitor = SpectralMonitor(every=1)
    with pytest.raises(ValueError, match=message):
        _train(tiny_model("llama"), tokenizer, tmp_path, monitor, collate=collate)


def test_monitor_refuses_gradient_checkpointing_enabled_on_the_model(tokenizer, tmp_path):
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing is on in the model"):
        _train(model, tokenizer, tmp_path, SpectralMonitor(every=1))
    with pytest.raises(ValueError, match="gradient checkpointing is on in TrainingArguments"):
        _train(tiny_model("llama"), tokenizer, tmp_path, SpectralMonitor(every=1), gradient_checkpointing=True)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SpectralMonitor(every=0), "every: a whole number of steps, at least 1; got 0"),
    (lambda: SpectralMonitor(every="2"), "every: a whole number of steps, at least 1; got '2'"),
    (lambda: SpectralMonitor(out="mon.jsonl"), "out mon.jsonl: name a .parquet file to write"),
    (lambda: SpectralMonitor(backend="zz"), "backend must be 'auto', 'cpp' or 'torch', got 'zz'"),
    (lambda: WITLoss(-1, 1), "prompt_weight must be a number >= 0, got -1"),
    (lambda: WITLoss(0, 0), "prompt_weight and response_weight are both 0: nothing to learn from"),
    (lambda: WITLoss("0.3"), "prompt_weight must be a number >= 0, got '0.3'"),
])
def test_bad_arguments_are_named_when_given(make, message):
    """Not at the first monitored step or the first loss, in the middle of the user's training."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make()
