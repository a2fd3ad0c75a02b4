import math

import pytest
import torch
from conftest import tiny_model

from gradspec.data.readers import Sample
from gradspec.data.templates import tokenize
from gradspec.training.dynamics import MEASURES, DynamicsCallback, from_checkpoints, measure, read_dynamics, summarise

SAMPLES = [
    Sample(0, [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue is one."}]),
    Sample(1, [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]),
    Sample(2, [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": " "}]),
]


def test_measure_matches_a_direct_computation(tokenizer):
    model = tiny_model("llama")
    got = measure(model, tokenizer, SAMPLES)
    for s in SAMPLES[:2]:
        t = tokenize(s.messages, tokenizer)
        ids = torch.tensor([t.input_ids])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        targets = [(pos - 1, tok) for pos, tok in enumerate(t.labels) if pos and tok != -100]
        p = torch.stack([probs[pos, tok] for pos, tok in targets])
        hits = [float(probs[pos].argmax() == tok) for pos, tok in targets]
        assert got[s.index]["mean_token_prob"] == pytest.approx(float(p.mean()), rel=1e-4)
        assert got[s.index]["perplexity"] == pytest.approx(math.exp(float(-p.log().mean())), rel=1e-4)
        assert got[s.index]["token_accuracy"] == pytest.approx(sum(hits) / len(hits))
    assert all(math.isnan(got[2][m]) for m in MEASURES)  # empty response: nothing to measure
    assert [got[i]["status"] for i in range(3)] == ["ok", "ok", "empty_response"]


def test_summary_statistics_and_forgetting():
    acc = {0: [0.2, 0.95, 0.5, 0.92, 0.3], 1: [0.95, 0.96, 0.97, 0.98, 0.99]}
    prob = {0: [0.1, 0.6, 0.3, 0.7, 0.2], 1: [0.8, 0.8, 0.9, 0.9, 1.0]}
    checkpoints = {f"c{k}": {i: {"mean_token_prob": prob[i][k], "perplexity": 1 / prob[i][k],
                                 "token_accuracy": acc[i][k]} for i in acc} for k in range(5)}
    table = summarise(checkpoints).set_index("index")
    assert table.loc[0, "forgetting_events"] == 2 and table.loc[1, "forgetting_events"] == 0
    assert table.loc[0, "correctness"] == pytest.approx(0.4) and table.loc[1, "correctness"] == 1.0
    assert table.loc[0, "confidence"] == pytest.approx(0.38) and table.loc[0, "variability"] == pytest.approx(
        float(torch.tensor(prob[0]).std(unbiased=False)))
    assert table.loc[1, "mean_perplexity"] == pytest.approx(sum(1 / p for p in prob[1]) / 5)
    assert table.loc[0, "token_accuracy"] == acc[0]


def test_callback_records_each_epoch(tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from gradspec.training.wit import WITCollator, WITLoss

    rows = [{"instruction": s.messages[0]["content"], "output": s.messages[1]["content"]} for s in SAMPLES[:2]]
    out = tmp_path / "dynamics.parquet"
    callback = DynamicsCallback(tokenizer, SAMPLES[:2], out)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, num_train_epochs=3,
                             learning_rate=1e-2, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_strategy="no")
    Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args, train_dataset=rows,
            data_collator=WITCollator(tokenizer), compute_loss_func=WITLoss(), callbacks=[callback]).train()
    table, meta = read_dynamics(out)
    assert meta["checkpoints"] == ["epoch 1", "epoch 2", "epoch 3"]
    assert table["index"].tolist() == [0, 1] and all(len(p) == 3 for p in table["perplexity"])
    assert all(p[-1] < p[0] for p in table["perplexity"])  # training lowered every sample's perplexity


def test_a_sample_without_response_tokens_gets_its_status_and_no_statistics(tokenizer):
    model = tiny_model("llama")
    table = summarise({"a": measure(model, tokenizer, SAMPLES), "b": measure(model, tokenizer, SAMPLES)})
    assert table["status"].tolist() == ["ok", "ok", "empty_response"]
    assert table.loc[:1, ["confidence", "correctness", "mean_perplexity"]].notna().all().all()
    assert table.loc[2, ["confidence", "variability", "correctness", "mean_perplexity"]].isna().all()
    assert table.loc[2, "forgetting_events"] == 0


def test_checkpoints_whose_tokenizer_leaves_no_response_tokens_stop(one_token_model_dir):
    with pytest.raises(ValueError, match="3 of 3 rows have no response tokens .*check the tokenizer"):
        from_checkpoints([str(one_token_model_dir)], SAMPLES)
