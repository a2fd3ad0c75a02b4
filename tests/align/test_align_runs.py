"""`gradspec align` and `gradspec.align`: score's runs (chunks, resume, Parquet conventions) with
the cosine columns, equal to the engine's; `select --by alignment` on the output."""

import json
import math

import pandas as pd
import pytest
import torch

import gradspec
from gradspec.cli import main
from gradspec.data.batching import pad_batch
from gradspec.data.models import load_model
from gradspec.data.templates import tokenize
from gradspec.runs.score_files import read_metadata

POOL = [
    {"instruction": "Write a haiku about rain.", "output": "Soft rain on the roof,\nquiet streets."},
    {"instruction": "What is 2+2?", "output": "4"},
    {"instruction": "Describe it", "input": "a cat", "output": ""},
    {"instruction": "Name a prime.", "output": "Seven is a prime number."},
    {"instruction": "Add 3 and 5.", "output": "3 + 5 = 8"},
]
TASK = [
    {"instruction": "What is 7+1?", "output": "8"},
    {"instruction": "Compute 6 times 2.", "output": "6 * 2 = 12"},
    {"instruction": "Say nothing.", "output": ""},  # no response tokens: left out
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_align_writes_cosines_equal_to_the_engines(tmp_path, tiny_model_dir):
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    out = tmp_path / "a.parquet"
    df = gradspec.align(pool, task, str(tiny_model_dir), out, aggregate="mean_gradient,mean,max",
                        max_length=64, progress=False, chunk_rows=2)
    assert df["status"].tolist() == ["ok", "ok", "empty_response", "ok", "ok"]
    names = ("align_mean_gradient", "align_mean", "align_max")
    assert not [c for c in df.columns if c.endswith("/effective_rank")]  # spectra off
    meta = read_metadata(out)
    assert meta["metrics"] == list(names) and meta["task"] == str(task.resolve())
    assert meta["task_examples"] == {"kept": 2, "rows": 3}
    model, tokenizer = load_model(str(tiny_model_dir))
    engine = gradspec.SpectralEngine(model, "attn", spectra=False)
    tokens = [tokenize([{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}],
                       tokenizer, "plain", 64) for r in TASK[:2]]
    engine.set_task([pad_batch(tokens, tokenizer.pad_token_id or 0, "cpu")], "mean_gradient,mean,max")
    for i in (0, 1, 3, 4):
        r = POOL[i]
        t = tokenize([{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}],
                     tokenizer, "plain", 64)
        want = engine.score(*pad_batch([t], tokenizer.pad_token_id or 0, "cpu"))
        for name in names:
            assert df.loc[i, name] == pytest.approx(float(want.alignment[name][0]), rel=1e-9, abs=1e-12)
        q = engine.part_names[0]
        got = df.loc[i, [f"{q}/{n}" for n in names]].to_numpy(float)
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.metrics[q][0], rtol=1e-9, atol=1e-12)
    assert all(math.isnan(df.loc[2, n]) for n in names)
    assert df.loc[[0, 1, 3, 4], list(names)].abs().le(1 + 1e-9).all().all()


def test_cli_align_spectra_resume_and_select(tmp_path, tiny_model_dir, capsys):
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    out = tmp_path / "a.parquet"
    args = ["align", "--data", str(pool), "--target", str(task), "--model", str(tiny_model_dir), "--out", str(out),
            "--max-length", "64", "--spectra", "--quiet", "--chunk-rows", "2"]
    assert main(args) == 0
    first = pd.read_parquet(out)
    q = "model.layers.0.self_attn.q_proj"
    assert {f"{q}/effective_rank", f"{q}/align_mean", "align_mean", "align_mean_gradient"} <= set(first.columns)
    assert main(args) == 2 and "exists" in capsys.readouterr().err  # neither --overwrite nor --resume
    half = tmp_path / "half.parquet"
    halves = [str(half) if a == str(out) else a for a in args]
    assert main([*halves, "--shard", "0/2"]) == 0 and not half.exists()  # chunks 0 and 2 of 0..2
    other = _write_jsonl(tmp_path / "other.jsonl", TASK[:1])
    changed = [*halves, "--resume"]
    changed[changed.index(str(task))] = str(other)
    assert main(changed) == 2 and "config differs: --target" in capsys.readouterr().err
    assert main([*halves, "--resume"]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(half), first)
    assert main([*args[:-4], "--aggregate", "median", "--overwrite"]) == 2
    assert "--aggregate takes" in capsys.readouterr().err
    chosen = tmp_path / "best.jsonl"
    assert main(["select", "--scores", str(out), "--by", "alignment", "--count", "2", "--out", str(chosen)]) == 0
    kept = [json.loads(line) for line in chosen.read_text().splitlines()]
    best = first[first["status"] == "ok"].nlargest(2, "align_mean")["index"].tolist()
    assert [r["instruction"] for r in kept] == [POOL[i]["instruction"] for i in sorted(best)]
    scores_only = tmp_path / "s.parquet"
    assert main(["score", "--data", str(pool), "--model", str(tiny_model_dir), "--out", str(scores_only),
                 "--max-length", "64", "--quiet"]) == 0
    assert main(["select", "--scores", str(scores_only), "--by", "alignment", "--count", "2",
                 "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "gradspec align" in capsys.readouterr().err
