"""A model's context bounds --max-length: a GPT-2 of 64 positions given longer rows scores them cut to 64
tokens and flagged truncated, with one warning, in every command that tokenizes for a model (a position
past the context has no embedding: IndexError before)."""

import json

import pandas as pd
import pytest
import torch

import gradspec
from gradspec.cli import main

WARNING = "--max-length {} exceeds the model's context of {} tokens; rows are cut to {} (flagged truncated)"
ROWS = [{"instruction": f"Task {i}: repeat the word", "output": "word " * n} for i, n in enumerate((8, 30, 90, 120))]


def _short_gpt2(folder, tokenizer, positions: int):
    """A tiny random GPT-2 (learned position embeddings: none past n_positions) with SmolLM2's tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=48, n_layer=2, n_head=4, n_positions=positions,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt64(tmp_path_factory, tokenizer):
    return _short_gpt2(tmp_path_factory.mktemp("gpt64"), tokenizer, 64)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "exceeds the model's context" in r.getMessage()]


def _check_cut(rows: pd.DataFrame) -> None:
    assert rows["status"].tolist() == ["ok", "ok", "truncated", "truncated"]
    assert rows["num_tokens"].tolist()[2:] == [64, 64] and rows["num_tokens"].max() == 64
    assert rows["loss"].notna().all()


def test_score_cuts_rows_to_the_model_context(gpt64, data, tmp_path, caplog):
    out = tmp_path / "s.parquet"
    assert main(["score", "--model", str(gpt64), "--data", str(data), "--out", str(out), "--quiet"]) == 0
    assert _warnings(caplog) == [WARNING.format(2048, 64, 64)]
    _check_cut(pd.read_parquet(out))
    caplog.clear()
    in_memory = gradspec.score(str(data), model=gpt64, progress=False)  # the Python API, without a run folder
    assert _warnings(caplog) == [WARNING.format(2048, 64, 64)]
    _check_cut(in_memory)
    pd.testing.assert_frame_equal(in_memory, pd.read_parquet(out), check_dtype=False)
    caplog.clear()
    shorter = gradspec.score(str(data), model=gpt64, max_length=32, progress=False)  # within the context: as asked
    assert _warnings(caplog) == [] and shorter["num_tokens"].max() == 32


def test_align_cuts_the_task_examples_too(gpt64, data, tmp_path, caplog):
    """The task's examples are cut like the data's rows, with the one warning; so are a store's (align --store)."""
    aligned = gradspec.align(str(data), str(data), model=gpt64, progress=False)
    assert _warnings(caplog) == [WARNING.format(2048, 64, 64)]
    _check_cut(aligned)
    assert aligned["align_mean"].notna().all()
    store, out = tmp_path / "store.parquet", tmp_path / "aligned.parquet"
    assert main(["project", "--model", str(gpt64), "--data", str(data), "--out", str(store), "--k", "2",
                 "--quiet"]) == 0
    caplog.clear()
    assert main(["align", "--store", str(store), "--target", str(data), "--out", str(out)]) == 0
    assert _warnings(caplog) == [WARNING.format(2048, 64, 64)]
    assert pd.read_parquet(out)["align_mean"].notna().all()


def test_train_dynamics_and_diagnose_cut_rows_to_the_model_context(gpt64, data, tmp_path, caplog):
    run = tmp_path / "train"
    assert main(["train", "--model", str(gpt64), "--data", str(data), "--out", str(run), "--max-steps", "1",
                 "--max-length", "100", "--monitor-every", "1"]) == 0
    assert _warnings(caplog) == [WARNING.format(100, 64, 64)]
    dynamics = pd.read_parquet(run / "dynamics.parquet")
    assert dynamics["status"].tolist() == ["ok", "ok", "truncated", "truncated"]
    caplog.clear()
    table = tmp_path / "dynamics.parquet"
    assert main(["dynamics", "--checkpoints", str(gpt64), str(run / "model"), "--data", str(data),
                 "--out", str(table)]) == 0
    assert _warnings(caplog) == [WARNING.format(2048, 64, 64)]  # once, not once per checkpoint
    assert pd.read_parquet(table)["status"].tolist() == ["ok", "ok", "truncated", "truncated"]
    caplog.clear()
    assert main(["diagnose", "--base", str(gpt64), "--model", str(run / "model"), "--data", str(data),
                 "--out", str(tmp_path / "diagnosis")]) == 0
    assert _warnings(caplog) == [WARNING.format(2048, 64, 64)]
    assert pd.read_parquet(tmp_path / "diagnosis" / "diagnosis.parquet")["status"].tolist()[2:] == \
        ["truncated", "truncated"]


def test_batch_memory_probes_fit_a_context_shorter_than_them(tmp_path, tokenizer, data):
    """The memory probes (one row of 32 and one of 64 tokens) stay within a 32-position model's context."""
    rows = gradspec.score(str(data), model=_short_gpt2(tmp_path / "gpt32", tokenizer, 32), progress=False)
    assert rows["status"].tolist() == ["ok", "truncated", "truncated", "truncated"]
    assert rows["num_tokens"].max() == 32 and rows["loss"].notna().all()
