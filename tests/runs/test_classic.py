"""Classic scores against direct computations with a plain forward pass."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gradspec

ROWS = [
    {"instruction": "Name a prime number.", "output": "Seven is a prime number."},
    {"instruction": "Say hello", "input": "in French", "output": "Bonjour tout le monde !"},
    {"instruction": "Count to three.", "output": "One, two, three."},
]


def _by_hand(model, tok, prompt: str, output: str, sep: str = "\n", eos: str = "") -> dict[str, float]:
    ids = tok(prompt + sep + output + eos)["input_ids"]
    start = len(tok(prompt + sep)["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        cond = [-torch.log_softmax(logits[t - 1], -1)[ids[t]].item() for t in range(start, len(ids))]
        probs = [torch.softmax(logits[t - 1], -1) for t in range(start, len(ids))]
        entropy = [-(p * p.log()).sum().item() for p in probs]
        accuracy = [float(logits[t - 1].argmax().item() == ids[t]) for t in range(start, len(ids))]
        alone_ids = tok(output + eos)["input_ids"]
        alone_logits = model(input_ids=torch.tensor([alone_ids])).logits[0].double()
        alone = [-torch.log_softmax(alone_logits[t - 1], -1)[alone_ids[t]].item() for t in range(1, len(alone_ids))]
    c, a = sum(cond) / len(cond), sum(alone) / len(alone)
    return {"loss": c, "perplexity": math.exp(c), "loss_response_alone": a, "ifd": c / a,
            "superfiltering_ifd": math.exp(c - a), "mean_entropy": sum(entropy) / len(entropy),
            "token_accuracy": sum(accuracy) / len(accuracy), "response_chars": len(output)}


def test_classic_scores_match_a_hand_computation(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    df = gradspec.score(data, str(tiny_model_dir), None, classic=True, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for i, row in enumerate(ROWS):
        prompt = row["instruction"] + ("\n" + row["input"] if "input" in row else "")
        want = _by_hand(model, tok, prompt, row["output"])
        for name, value in want.items():
            assert df.loc[i, name] == pytest.approx(value, rel=1e-5), (i, name)
    assert (df["status"] == "ok").all()


def test_a_trl_text_row_s_response_alone_ends_in_eos_as_its_full_text_does(tmp_path, tiny_model_dir):
    """TRL's text completion is scored with the tokenizer's EOS after it (prompt + completion + EOS): IFD's
    response alone ends in it too, or the ratio compares two different responses."""
    row = {"prompt": "Name a prime number.", "completion": " Seven is a prime number."}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(row) + "\n")
    df = gradspec.score(data, str(tiny_model_dir), None, classic=True, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    want = _by_hand(model, tok, row["prompt"], row["completion"], sep="", eos=tok.eos_token)
    for name, value in want.items():
        assert df.loc[0, name] == pytest.approx(value, rel=1e-5), name


def test_classic_columns_absent_unless_asked(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    df = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    assert "ifd" not in df.columns and "mean_entropy" not in df.columns


def test_one_token_response_flags_ifd_undefined(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "What is 2+2?", "output": "4"}) + "\n"
                    + json.dumps({"instruction": "x " * 300, "output": "cut"}) + "\n")
    df = gradspec.score(data, str(tiny_model_dir), None, classic=True, max_length=64, progress=False)
    assert df["status"].tolist() == ["ifd_undefined", "prompt_too_long"]
    assert math.isnan(df.loc[0, "ifd"]) and math.isfinite(df.loc[0, "perplexity"])
    assert df.loc[1, ["ifd", "perplexity", "mean_entropy"]].isna().all()
