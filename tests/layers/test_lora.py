"""LoRA / PEFT models: the adapter matrices lora_A (d_in -> r) and lora_B (r -> d_out) scored by the
exact engine against their materialised per-sample gradients; base layers under their own names."""

import json

import pandas as pd
import pytest
import torch
from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model

from gradspec.cli import main
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.targets import select_targets

peft = pytest.importorskip("peft")
VOCAB = 500
LENGTHS = [3, 6, 11, 25]  # below and above r: both the T x T and the materialised paths


def lora_model(kind: str):
    targets = {"gpt2": ["c_attn"], "phi3": ["qkv_proj", "o_proj"]}.get(kind, ["q_proj", "v_proj", "down_proj"])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                             fan_in_fan_out=kind == "gpt2")
    torch.manual_seed(1)  # init_lora_weights=False: lora_B is random, not zero, so lora_A has a gradient
    return peft.get_peft_model(tiny_model(kind, vocab=VOCAB), config)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "phi3"])
def test_lora_matrices_match_the_reference(kind):
    model = lora_model(kind)
    names = [p.name for t in select_targets(model, "lora") for p in t.parts]
    assert names and all(n.endswith((".lora_A.default", ".lora_B.default")) for n in names)
    assert {p.d_out for t in select_targets(model, "lora_A") for p in t.parts} == {4}
    seqs = random_sequences(LENGTHS, VOCAB)
    scores = SpectralEngine(model, "lora").score(*padded_batch(seqs))
    assert_matches_reference(model, scores, seqs, "lora")


def test_base_layers_are_scored_as_the_modules_they_adapt():
    """Under an adapter, q_proj's base layer is scored as q_proj: its gradient is the adapted
    module's output gradient times its input, as without the adapter."""
    model = lora_model("llama")
    plain = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences(LENGTHS, VOCAB)
    scores = SpectralEngine(model, "attn").score(*padded_batch(seqs))
    assert set(scores.metrics) == {p.name for t in select_targets(plain, "attn") for p in t.parts}
    assert_matches_reference(model, scores, seqs, "attn")


def test_the_peft_model_is_left_as_it_was_found():
    model = lora_model("llama").train()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert any(flags.values()) and not all(flags.values())  # the adapter trains, the base is frozen
    SpectralEngine(model, "lora").score(*padded_batch(random_sequences([7, 9], VOCAB)))
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags and model.training
    assert all(p.grad is None for p in model.parameters())


def test_score_an_adapter_folder(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(2)
    adapter = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tiny_model_dir)
    data, out = tmp_path / "d.jsonl", tmp_path / "s.parquet"
    data.write_text(json.dumps({"instruction": "Name a colour.", "output": "Blue is a colour."}) + "\n")
    assert main(["score", "--model", str(tmp_path / "adapter"), "--data", str(data), "--modules", "lora",
                 "--out", str(out), "--quiet"]) == 0
    df = pd.read_parquet(out)
    assert df["status"].tolist() == ["ok"]
    lora_columns = [c for c in df.columns if c.endswith("/effective_rank")]
    assert len(lora_columns) == 2 * 2 * 2  # 2 layers x (q, v) x (lora_A, lora_B)
    assert all(".lora_A.default/" in c or ".lora_B.default/" in c for c in lora_columns)
    assert (df[lora_columns] <= 2 + 1e-9).all(axis=None)  # rank <= r
