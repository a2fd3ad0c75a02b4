"""Bad input through the CLI: each case gets a clear message or a flagged row, and the run keeps
what it has computed."""

import json
import math
import pickle

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from gradspec.cli import main
from gradspec.data.models import load_model

GOOD = {"instruction": "Name a colour.", "output": "Blue is a colour."}


def _score(model, data, out, *extra):
    return main(["score", "--model", str(model), "--data", str(data), "--out", str(out), "--quiet", *extra])


def _lines(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


BAD_LINES = [
    (b"{not json", "malformed JSON: Expecting property name enclosed in double quotes (column 2)"),
    (b'{"instruction": "\xff", "output": "x"}', "invalid UTF-8 (invalid start byte at byte 17)"),
    (b'{"instruction": "q"}', "missing field 'output'"),
    (b'{"instruction": "q", "output": 7}', "field 'output' must be a string, got int"),
    (b'["a", "list"]', "expected a JSON object, got list"),
    # JSON's escape of a lone surrogate reads as a str no tokenizer takes (a TypeError naming no row, before)
    (rb'{"instruction": "s \ud800", "output": "r"}',
     "field 'instruction' is not valid Unicode text (a lone surrogate, '\\ud800', at character 2)"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_LINES)
def test_malformed_row_fails_by_default_naming_file_and_line(tmp_path, tiny_model_dir, capsys, line, reason):
    data = _lines(tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), line])
    assert _score(tiny_model_dir, data, tmp_path / "s.parquet") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gradspec: error: {data}:2: {reason}") and err.count("\n") == 1  # one line, no traceback


def test_skip_flags_rows_lists_them_and_scores_the_rest(tmp_path, tiny_model_dir, capsys):
    lines = [json.dumps(GOOD).encode()]
    for line, _ in BAD_LINES:
        lines += [line, json.dumps(GOOD).encode()]
    data = _lines(tmp_path / "d.jsonl", lines)
    out = tmp_path / "s.parquet"
    assert _score(tiny_model_dir, data, out, "--on-error", "skip") == 0
    assert "skipped rows and why: " + str(tmp_path / "s.errors.jsonl") in capsys.readouterr().out
    df = pd.read_parquet(out)
    bad = list(range(1, 2 * len(BAD_LINES), 2))
    assert df["status"].tolist() == ["input_error" if i in bad else "ok" for i in range(len(lines))]
    assert df.loc[bad, "loss"].isna().all() and df.drop(index=bad)["loss"].gt(0).all()
    errors = [json.loads(x) for x in (tmp_path / "s.errors.jsonl").read_text().splitlines()]
    assert [e["index"] for e in errors] == bad
    for e, (_, reason) in zip(errors, BAD_LINES, strict=True):
        assert e["error"] == f"{data}:{e['index'] + 1}: {reason}"
    assert df.loc[bad, "error"].tolist() == [e["error"] for e in errors]


def test_a_truncated_parquet_file_is_named(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "d.parquet"
    pd.DataFrame([GOOD] * 3).to_parquet(data)
    data.write_bytes(data.read_bytes()[:-30])
    assert _score(tiny_model_dir, data, tmp_path / "s.parquet", "--on-error", "skip") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gradspec: error: {data}: not a readable Parquet file (Parquet magic bytes not found")
    assert err.count("\n") == 1


def test_text_problems_are_flagged_rows(tmp_path, tiny_model_dir):
    rows = [GOOD, {"instruction": "", "output": "An answer to nothing."}, {"instruction": "Say it.", "output": " "},
            {"instruction": "word " * 80, "output": "late"}, {"instruction": "Name a colour:\n", "output": "Blue."}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _score(tiny_model_dir, data, tmp_path / "s.parquet", "--max-length", "40") == 0
    df = pd.read_parquet(tmp_path / "s.parquet")
    assert df["status"].tolist() == ["ok", "empty_prompt", "empty_response", "prompt_too_long", "boundary_merge"]
    # an empty prompt and a boundary merge are still scored
    assert df["loss"].notna().tolist() == [True, True, False, False, True]
    assert df.loc[4, "num_response_tokens"] == 2  # "Blue" and ".", not the "\n" before them


def test_most_rows_without_response_tokens_stop_the_run(tmp_path, one_token_model_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    assert _score(one_token_model_dir, data, tmp_path / "s.parquet") == 2
    err = capsys.readouterr().err
    assert "gradspec: error: 2 of 2 rows have no response tokens (no_response_tokens 2): check the tokenizer" in err
    assert not (tmp_path / "s.parquet").exists()


def test_nonfinite_loss_flags_the_row_and_the_run_goes_on(tmp_path, tokenizer):
    """A NaN in one token's embedding poisons exactly the samples that contain the token."""
    model = tiny_model("llama")
    [poison] = tokenizer(" zebra", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = math.nan
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    rows = [GOOD, {"instruction": "Name an animal.", "output": "A zebra."}, GOOD]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _score(tmp_path / "m", data, tmp_path / "s.parquet") == 0
    df = pd.read_parquet(tmp_path / "s.parquet")
    assert df["status"].tolist() == ["ok", "nonfinite_loss", "ok"] and df["loss"].isna().tolist() == [0, 1, 0]


def test_unknown_model_and_modules(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD))
    assert _score(tmp_path / "nowhere", data, tmp_path / "a.parquet") == 2
    assert f"--model {tmp_path / 'nowhere'}: no such folder, and not a Hub model id (org/name) either" \
        in capsys.readouterr().err
    assert _score(tiny_model_dir, data, tmp_path / "b.parquet", "--modules", "*.lora_A") == 2
    assert "no module matches" in capsys.readouterr().err
    assert not (tmp_path / "b.parquet.parts").exists()  # nothing is started for a model that cannot be scored


class _Plant:
    """Unpickling this runs code: it would create the file named in the test."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_are_not_unpickled(tmp_path, tiny_model_dir):
    """A model folder whose weights are a pickle that runs code: loading refuses, nothing runs."""
    folder = tmp_path / "evil"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    planted = tmp_path / "pwned"
    weights = {"model.embed_tokens.weight": _Plant(str(planted))}
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(weights, protocol=2))
    with pytest.raises(Exception, match="(?i)weights_only|unpickl"):
        load_model(str(folder))
    assert not planted.exists()
