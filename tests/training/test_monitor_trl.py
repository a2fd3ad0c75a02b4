"""SpectralMonitorCallback in TRL's SFTTrainer, as a new user runs it: a prompt-completion dataset
(completion-only loss) and SFTConfig's defaults, gradient checkpointing on."""

import json

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg.metrics import metric_names
from gradspec.training.monitor_callback import SpectralMonitorCallback
from gradspec.training.sample_index import keep_sample_index, with_sample_index
from gradspec.training.wit import WITCollator

pytest.importorskip("trl")

ROWS = [
    {"prompt": "Name a colour.", "completion": " Blue."},
    {"prompt": "What is two plus two?", "completion": " Four, since two and two make four."},
    {"prompt": "Say something long, please.", "completion": " Something long" * 5},
    {"prompt": "Hi", "completion": " Hello there, how can I help?"},
]


def test_sft_trainer_rows_equal_gradspec_score_of_the_same_tokens(tokenizer, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    # bf16 autocast, SFTConfig's default, is off: the rows are compared with an fp32 reference
    config = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=1,
                       learning_rate=0.0, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
                       bf16=False)
    assert config.gradient_checkpointing  # TRL's default: the monitor must work under it
    out = tmp_path / "monitor.parquet"
    trainer = SFTTrainer(model=tiny_model("llama"), args=config, train_dataset=Dataset.from_list(ROWS),
                         processing_class=tokenizer, callbacks=[SpectralMonitorCallback(every=1, modules="all",
                                                                                        out=out)])
    trainer.train()
    rows = pd.read_parquet(out)
    assert len(rows) == 4 and (rows["status"] == "ok").all() and set(rows["loss_kind"]) == {"ntp"}
    # The same tokens, labels and padding as TRL made them, scored by gradspec
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert (batch["labels"] == -100).sum() > (batch["attention_mask"] == 0).sum()  # prompts carry no loss
    want = SpectralEngine(tiny_model("llama"), "all").score(batch["input_ids"], batch["attention_mask"],
                                                             batch["labels"])
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) == 4
    for _, row in rows.iterrows():
        i = lengths.index(row["num_tokens"])
        assert row["loss"] == pytest.approx(float(want.loss[i]), rel=1e-5)
        assert row["num_loss_tokens"] == int(want.num_response_tokens[i])
        for name, values in want.metrics.items():
            got = torch.tensor([row[f"{name}/{m}"] for m in metric_names()], dtype=torch.float64)
            torch.testing.assert_close(got, values[i], rtol=1e-4, atol=0, msg=name)


@pytest.mark.parametrize("collator", ["trl", "wit"])
def test_sft_trainer_rows_name_their_sample(tokenizer, tmp_path, collator):
    """Rows given their index (with_sample_index) reach the monitor's sample_index through TRL's own
    collator (wrapped by keep_sample_index) or WITCollator: each row is its sample's, by its length."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    wit = collator == "wit"
    rows = [{"instruction": r["prompt"], "output": r["completion"]} for r in ROWS] if wit else ROWS
    config = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                       learning_rate=0.0, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
                       bf16=False, remove_unused_columns=False,  # else Trainer drops the column
                       dataset_kwargs={"skip_prepare_dataset": True} if wit else None)
    out = tmp_path / "monitor.parquet"
    trainer = SFTTrainer(model=tiny_model("llama"), args=config,
                         train_dataset=with_sample_index(Dataset.from_list(rows)), processing_class=tokenizer,
                         data_collator=WITCollator(tokenizer) if wit else None,
                         callbacks=[SpectralMonitorCallback(every=1, out=out)])
    if not wit:
        trainer.data_collator = keep_sample_index(trainer.data_collator)
    trainer.train()
    got = pd.read_parquet(out)
    assert sorted(got["sample_index"]) == [0, 1, 2, 3]
    lengths = [int(trainer.data_collator([trainer.train_dataset[i]])["attention_mask"].sum()) for i in range(4)]
    assert len(set(lengths)) == 4
    assert got["num_tokens"].tolist() == [lengths[i] for i in got["sample_index"]]


@pytest.mark.parametrize("layout", ["text", "conversational", "earlier turns"])
def test_trl_s_prompt_completion_rows_are_read_and_tokenized_as_trl_does(tokenizer, tmp_path, layout):
    """TRL's prompt/completion columns are read without field flags, and gradspec scores the tokens and the
    completion mask TRL trains on: texts joined as TRL joins them (prompt + completion + EOS, under the plain
    template), lists of messages as one conversation (under the chat template), the prompt's own assistant
    turns context, not scored (TRL's loss is on the completion alone)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from gradspec.data.readers import read_samples
    from gradspec.data.templates import IGNORE_INDEX, tokenize

    rows = [{"prompt": "Name a colour.", "completion": " Blue."},
            {"prompt": "What is 2+2?\n", "completion": "Four, of course."}]
    if layout != "text":
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "completion": [{"role": "assistant", "content": r["completion"].strip()}]} for r in rows]
    if layout == "earlier turns":
        for r in rows:
            r["prompt"] = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi! Ask away."},
                           *r["prompt"]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = SFTConfig(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, bf16=False)
    prepared = SFTTrainer(model=tiny_model("llama"), args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer).train_dataset
    template = "plain" if layout == "text" else "chat"
    for sample, trl_row in zip(read_samples(path), prepared, strict=True):
        got = tokenize(sample.messages, tokenizer, template, 512)
        trained = trl_row.get("completion_mask") or [int(label != IGNORE_INDEX) for label in trl_row["labels"]]
        assert got.status == "ok" and got.input_ids == trl_row["input_ids"]
        assert [int(label != IGNORE_INDEX) for label in got.labels] == trained and any(trained)
        # gradspec train's rows (the samples' messages) through WITCollator: the same tokens, joined as TRL's
        batch = WITCollator(tokenizer, template=template)([{"messages": sample.messages}])
        assert batch["input_ids"][0].tolist() == got.input_ids


@pytest.mark.parametrize("extra", ["compute_loss_func", "label_smoothing_factor", "a second forward with grad"])
def test_a_step_with_extra_forwards_gives_rows_or_says_why_not(tokenizer, tmp_path, caplog, extra):
    """TRL's extra forwards (a compute_loss_func's or label smoothing's forward for the logits, then the
    fused head's without grad for its metrics) give rows; a loss that runs a second forward with grad
    per micro-batch gives a warning that names the step, never silence."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class TwoForwards(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, dict(inputs), return_outputs, num_items_in_batch)
            return loss + 0 * model(input_ids=inputs["input_ids"]).logits.sum()

    smoothing = {"label_smoothing_factor": 0.1} if extra == "label_smoothing_factor" else {}
    config = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                       learning_rate=0.0, report_to=[], save_strategy="no", use_cpu=True, bf16=False, **smoothing)
    loss_func = {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean()} \
        if extra == "compute_loss_func" else {}
    out = tmp_path / "monitor.parquet"
    trainer_class = TwoForwards if extra == "a second forward with grad" else SFTTrainer
    trainer = trainer_class(model=tiny_model("llama"), args=config, train_dataset=Dataset.from_list(ROWS),
                            processing_class=tokenizer, callbacks=[SpectralMonitorCallback(every=1, out=out)],
                            **loss_func)
    with caplog.at_level("WARNING", logger="gradspec"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if r.name == "gradspec"]
    if extra == "a second forward with grad":
        assert not out.exists() and any("step 1 has more forwards than its 1 micro-batches" in w for w in warned)
    else:
        rows = pd.read_parquet(out)
        assert len(rows) == 2 and (rows["status"] == "ok").all() and not warned
