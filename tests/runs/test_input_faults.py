"""Faults in the input and in the arguments, met the same way however a run is split: rows read
before a malformed row are kept, Python arguments of the wrong type are named, carried columns of
mixed types merge, and the response-token guard judges the same rows in every process."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gradspec
from gradspec import Fields
from gradspec.cli import main
from gradspec.data.readers import Sample, read_samples
from gradspec.runs.config import ScoreConfig

GOOD = {"instruction": "Name a colour.", "output": "Blue is a colour."}
EMPTY = {"instruction": "Say nothing.", "output": " "}  # empty_response: no response token
BAD = {"instruction": "Name a colour."}  # missing field 'output'


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _score(model, data, out, *extra):
    return main(["score", "--model", str(model), "--data", str(data), "--out", str(out), "--quiet",
                 "--batch-tokens", "256", *extra])


def _parts(out: Path) -> list[int]:
    return sorted(int(p.stem) for p in out.with_name(out.name + ".parts").glob("*.parquet"))


# 1. Rows read before a malformed row


@pytest.mark.parametrize(("chunk_rows", "bad", "kept"), [
    (1, 1, [0]),  # the bad row opens chunk 1: chunk 0 was read whole, and is written
    (2, 2, [0]),
    (3, 5, [0]),  # the bad row closes chunk 1: chunk 0 kept, chunk 1 (rows 3 and 4 read) cannot be whole
    (2, 1, []),  # the bad row is in chunk 0: nothing whole to keep, no run left to resume
])
def test_chunks_read_before_a_malformed_row_are_written(tmp_path, tiny_model_dir, capsys, chunk_rows, bad, kept):
    rows = [GOOD] * 7
    data = _jsonl(tmp_path / "d.jsonl", rows[:bad] + [BAD] + rows[bad + 1:])
    out = tmp_path / "s.parquet"
    assert _score(tiny_model_dir, data, out, "--chunk-rows", str(chunk_rows)) == 2
    assert f"gradspec: error: {data}:{bad + 1}: missing field 'output'" in capsys.readouterr().err
    assert _parts(out) == kept and not out.exists()
    for chunk in kept:
        part = pq.read_table(out.with_name(out.name + ".parts") / f"{chunk:08d}.parquet").to_pandas()
        assert part["index"].tolist() == list(range(chunk * chunk_rows, (chunk + 1) * chunk_rows))
        assert (part["status"] == "ok").all() and part["loss"].gt(0).all()


def test_resume_after_the_malformed_row_is_fixed_loses_nothing(tmp_path, tiny_model_dir, capsys, caplog):
    bad = {"instruction": "Name a colour.", "output": 77}  # the fix below changes the file's size (its data_bytes)
    data = _jsonl(tmp_path / "d.jsonl", [GOOD, bad, GOOD])
    out = tmp_path / "s.parquet"
    assert _score(tiny_model_dir, data, out, "--chunk-rows", "1") == 2
    assert f"{data}:2: field 'output' must be a string, got int" in capsys.readouterr().err
    assert _parts(out) == [0]
    written = pq.read_table(out.with_name(out.name + ".parts") / "00000000.parquet")
    text = data.read_text()
    data.write_text(text.replace('"output": 77}', '"output": "seventy-seven"}'))
    assert len(data.read_text()) != len(text)
    assert _score(tiny_model_dir, data, out, "--chunk-rows", "1", "--resume") == 0
    assert caplog.text.count("data_bytes was") == 1 and "the parts already written are kept" in caplog.text
    df = pd.read_parquet(out)
    assert df["index"].tolist() == [0, 1, 2] and (df["status"] == "ok").all()
    assert df.iloc[[0]].reset_index(drop=True).equals(written.to_pandas())  # chunk 0 as the first run wrote it


def test_python_api_keeps_chunks_before_a_malformed_row(tmp_path, tiny_model_dir):
    data = _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, BAD])
    out = tmp_path / "s.parquet"
    with pytest.raises(gradspec.InputError, match=rf"{data}:3: missing field 'output'"):
        gradspec.score(data, tiny_model_dir, out, chunk_rows=2, progress=False)
    assert _parts(out) == [0]


# 2. Python arguments of the wrong type


@pytest.mark.parametrize(("options", "message"), [
    ({"modules": 123}, "modules must be a str or a list of str, got int 123"),
    ({"max_length": "64"}, "max_length must be an int, got str '64'"),
    ({"max_length": True}, "max_length must be an int, got bool True"),
    ({"limit": 2.5}, "limit must be an int or None, got float 2.5"),
    ({"data": 7}, "data must be a str, a pathlib.Path, a list of dicts, a pandas DataFrame, a datasets.Dataset or "
                  "None, got int 7"),
    ({"fields": ["instruction"]}, "fields must be a Fields or a dict of its fields, got list"),
    ({"fields": {"question": "q"}}, "fields has no field 'question': a dict's keys are Fields' fields (instruction, "),
    ({"fields": {"output": 3}}, "fields.output must be a str, got int 3"),
    ({"fields": {"output": None}}, "fields.output must be a str, got NoneType None"),
    ({"progress": "no"}, "progress must be a bool, got str 'no'"),
    ({"batch_tokens": "256"}, "batch_tokens must be an int or None, got str '256'"),
    ({"aggregate": 1}, "aggregate must be a str or a list of str, got int 1"),
    ({"split": None}, "split must be a str, got NoneType None"),
    ({"device": 0}, "device must be a str or a torch.device, got int 0"),
    ({"out": 1.5}, "out must be a str or a pathlib.Path or None, got float 1.5"),
])
def test_python_arguments_of_the_wrong_type_are_named(tmp_path, options, message):
    data = _jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(TypeError) as caught:
        gradspec.score(**{"data": data, "progress": False, **options})
    assert message in str(caught.value)
    assert not list(tmp_path.glob("*.parquet*"))


def test_align_and_score_config_check_types_too(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(TypeError, match="max_length must be an int, got str '64'"):
        gradspec.align(data, data, max_length="64", progress=False)
    with pytest.raises(TypeError, match="rank must be an int, got str '8'"):
        ScoreConfig(rank="8")
    with pytest.raises(TypeError, match="hub.streaming must be a bool, got str 'yes'"):
        ScoreConfig(hub={"streaming": "yes"})


def test_python_ranges_are_named_as_python_names_them(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ValueError, match="^max_length must be at least 1, got 0$"):
        gradspec.score(data, max_length=0, progress=False)
    with pytest.raises(ValueError, match="^project must be at least 0, got -1$"):
        gradspec.score(data, project=-1, progress=False)


def test_python_arguments_in_the_forms_a_user_would_give_them(tmp_path, tiny_model_dir):
    """fields as a dict (of Fields' names to the input's columns: how the manifest records them), a
    Path for the model, numpy ints, a list of modules: taken, and the config kept in plain form."""
    config = ScoreConfig(data=tmp_path / "d.jsonl", modules=["q", "v"], max_length=np.int64(64),
                         fields={"instruction": "prompt", "output": "answer"})
    assert config == ScoreConfig(data=str(tmp_path / "d.jsonl"), modules="q,v", max_length=64,
                                 fields=Fields(instruction="prompt", output="answer"))
    assert type(config.max_length) is int and json.dumps(config.describe())
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "Name a colour.", "answer": "Blue is a colour.", "id": 4}])
    df = gradspec.score(data, Path(tiny_model_dir), tmp_path / "s.parquet", modules=["q", "v"],
                        max_length=np.int64(64), fields={"instruction": "prompt", "output": "answer"}, progress=False)
    assert df["status"].tolist() == ["ok"] and df["id"].tolist() == [4]


# 3. Carried columns whose type changes


MIXED = [0, 1, "a7", "b8", None, 2.5]  # ints, then strings (another chunk at --chunk-rows 2), a null, a float


def _carrying(path: Path, ids) -> Path:
    return _jsonl(path, [{**GOOD, "id": i, "reward": k + 0.5 if k % 2 else k} for k, i in enumerate(ids)])


@pytest.mark.parametrize("chunk_rows", ["2", "6"])  # across chunks; within one
def test_a_carried_column_of_mixed_types_is_text_and_merges(tmp_path, tiny_model_dir, chunk_rows):
    data = _carrying(tmp_path / "d.jsonl", MIXED)
    out = tmp_path / "s.parquet"
    assert _score(tiny_model_dir, data, out, "--chunk-rows", chunk_rows) == 0
    table = pq.read_table(out)
    assert table.schema.field("id").type == pa.string()
    assert table["id"].to_pylist() == ["0", "1", "a7", "b8", None, "2.5"]
    assert table.schema.field("reward").type == pa.float64()  # ints and floats: one kind, numbers
    assert table["reward"].to_pylist() == [0, 1.5, 2, 3.5, 4, 5.5]


def test_a_mixed_column_is_text_in_every_part_however_the_run_is_split(tmp_path, tiny_model_dir):
    """Shard 0 scores chunks whose ids are all ints, shard 1 chunks whose ids are all strings: each
    stores them as the whole input's type says (text), so the parts merge, equal to one run."""
    data = _carrying(tmp_path / "d.jsonl", MIXED)
    whole = tmp_path / "whole.parquet"
    assert _score(tiny_model_dir, data, whole, "--chunk-rows", "2") == 0
    out = tmp_path / "s.parquet"
    assert _score(tiny_model_dir, data, out, "--chunk-rows", "2", "--shard", "1/2") == 0
    assert _score(tiny_model_dir, data, out, "--chunk-rows", "2", "--shard", "0/2") == 0
    assert pq.read_schema(out.with_name(out.name + ".parts") / "00000000.parquet").field("id").type == pa.string()
    assert main(["merge", "--out", str(out)]) == 0
    assert pq.read_table(out).equals(pq.read_table(whole))


def test_score_samples_makes_a_chunks_mixed_column_text(tokenizer):
    """Samples from elsewhere than a JSON file (a list here; a Parquet file or a `datasets` split type
    their columns once): a column whose values mix kinds within a chunk is text there too."""
    from conftest import tiny_model

    from gradspec.engine.spectral_engine import SpectralEngine
    from gradspec.runs.chunks import score_samples

    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    samples = [Sample(i, chat, {"id": v}) for i, v in enumerate([3, "x3", True, None])]
    rows: list[dict] = []
    with SpectralEngine(tiny_model("llama"), "attn") as engine:
        score_samples(samples, engine, tokenizer, lambda _, chunk: rows.extend(chunk), progress=False)
    assert [r["id"] for r in rows] == ["3", "x3", "true", None] and samples[0].carried["id"] == 3
    assert pa.table({"id": [r["id"] for r in rows]}).schema.field("id").type == pa.string()


def test_mixed_columns_rule():
    from gradspec.data.carried_columns import as_text, mixed_columns

    samples = [Sample(0, [], {"a": 1, "b": True, "c": 1, "d": None, "e": 2**70}),
               Sample(1, [], {"a": 2.5, "b": 1, "c": "x", "d": None}),
               Sample(2, [], {"a": None, "b": None, "f": "only"})]
    assert mixed_columns(samples) == {"b", "c", "e"}  # ints with floats are numbers; nulls mix with anything
    assert [as_text(v) for v in (True, 7, 2.5, float("nan"), "s", None)] == ["true", "7", "2.5", "NaN", "s", None]


def test_the_whole_inputs_kinds_decide_from_the_first_row(tmp_path):
    data = _carrying(tmp_path / "d.jsonl", MIXED)
    first = next(ScoreConfig(data=str(data)).samples(lambda i: i == 0))
    assert first.carried["id"] == "0"  # text, though this row's own id is an int
    assert next(ScoreConfig(data=str(data), limit=2).samples()).carried["id"] == 0  # the rows a run covers decide
    assert [s.carried["id"] for s in read_samples(data)][:2] == [0, 1]  # reading alone keeps the input's values


# 4. The response-token guard


def test_the_response_token_guard_judges_the_same_rows_however_the_run_is_split(tmp_path, tiny_model_dir, capsys):
    """Chunk 0 fine, chunk 1 all empty responses: half the input, so one run goes on; so do a shard
    or a --resume that scores chunk 1 alone (they judged chunk 1's rows alone: 2 of 2)."""
    data = _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, EMPTY, EMPTY])
    out = tmp_path / "s.parquet"
    assert _score(tiny_model_dir, data, out, "--chunk-rows", "2", "--shard", "1/2") == 0
    assert _parts(out) == [1]
    resumed = tmp_path / "r.parquet"
    assert _score(tiny_model_dir, data, resumed, "--chunk-rows", "2", "--shard", "0/2") == 0
    assert _score(tiny_model_dir, data, resumed, "--chunk-rows", "2", "--resume") == 0  # chunk 1 alone
    assert pd.read_parquet(resumed)["status"].tolist() == ["ok", "ok", "empty_response", "empty_response"]


def test_the_response_token_guard_stops_every_part_of_a_run_alike(tmp_path, tiny_model_dir, capsys):
    """Three of four rows have no response token: one run stops, and so does the shard whose own
    chunk is half fine (1 of 2), before it scores anything."""
    data = _jsonl(tmp_path / "d.jsonl", [GOOD, EMPTY, EMPTY, EMPTY])
    for i, extra in enumerate([("--shard", "0/2"), ("--shard", "1/2"), ()]):
        out = tmp_path / f"s{i}.parquet"
        assert _score(tiny_model_dir, data, out, "--chunk-rows", "2", *extra) == 2
        assert "3 of 4 rows have no response tokens (empty_response 3): the responses are blank: check the output " \
               "or messages field (judged on the input's first 4 rows)" in capsys.readouterr().err
        assert not out.with_name(out.name + ".parts").exists()


def test_a_stream_shorter_than_the_limit_ends_the_run_where_it_ends(tmp_path, tiny_model_dir):
    """A folder of JSONL files streamed says nothing of its size: the run plans --limit rows (51 chunks
    of 2 here), the stream ends after 5, and the run merges the 3 chunks it held (the README's
    `--streaming --limit 100000` on a smaller split); a later merge of the same run agrees."""
    folder = tmp_path / "plain"
    folder.mkdir()
    _jsonl(folder / "part.jsonl", [GOOD] * 5)
    out = tmp_path / "s.parquet"
    df = gradspec.score(folder, tiny_model_dir, out, streaming=True, limit=101, chunk_rows=2, progress=False)
    assert df["index"].tolist() == [0, 1, 2, 3, 4] and set(df["status"]) == {"ok"}
    assert not (tmp_path / "s.parquet.parts").exists()
    parted = tmp_path / "p.parquet"
    assert main(["score", "--data", str(folder), "--model", str(tiny_model_dir), "--out", str(parted), "--streaming",
                 "--limit", "101", "--chunk-rows", "2", "--no-merge", "--quiet"]) == 0
    assert main(["merge", "--out", str(parted)]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(parted).drop(columns="status"), df.drop(columns="status"),
                                  check_dtype=False)


def test_where_a_stream_ended_is_recorded_before_its_last_part(tmp_path, tiny_model_dir, monkeypatch):
    """A run killed after writing the part that holds the stream's last row still knows where the
    input ended: --resume and merge then expect no further chunk."""
    from gradspec.runs.run_folder import RunFolder

    folder = tmp_path / "plain"
    folder.mkdir()
    _jsonl(folder / "part.jsonl", [GOOD] * 5)
    seen = []
    write_part = RunFolder.write_part

    def recording(self, chunk, rows, metadata):
        seen.append((chunk, (self.path / "input_end.json").exists()))
        write_part(self, chunk, rows, metadata)

    monkeypatch.setattr(RunFolder, "write_part", recording)
    gradspec.score(folder, tiny_model_dir, tmp_path / "s.parquet", streaming=True, limit=101, chunk_rows=2,
                   progress=False)
    assert seen == [(0, False), (1, False), (2, True)]
