"""Rows given in memory to gradspec.score and gradspec.align (a list of dicts, a pandas DataFrame, a
datasets.Dataset) are read as a file's rows are: the same rows come out, errors name data[i], and a run
folder records them by their content's hash (a resume continues with the same rows only)."""

import json

import pandas as pd
import pytest

import gradspec
from gradspec.cli import main
from gradspec.data.errors import InputError
from gradspec.data.in_memory import holding, is_label
from gradspec.data.readers import read_samples
from gradspec.options import OptionError
from gradspec.runs.run_folder import RunFolder

ROWS = [  # the first row has every field: datasets.Dataset.from_list takes its columns from it
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "id": 0, "source": "math"},
    {"instruction": "Say hello.", "input": None, "output": "Hello, how can I help?", "id": 1, "source": "chat"},
    {"instruction": "Name a colour.", "input": "one", "output": "Blue.", "id": 2, "source": "quiz"},
    {"instruction": "Repeat the word.", "input": None, "output": "word " * 12, "id": 3, "source": "echo"},
    {"instruction": "Count to three.", "input": None, "output": "1, 2, 3", "id": 4, "source": "math"},
]
TASK = [{"messages": [{"role": "user", "content": "Add 1 and 1."}, {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _kinds(rows):
    """The same rows as each in-memory kind."""
    datasets = pytest.importorskip("datasets")
    return {"list": rows, "DataFrame": pd.DataFrame(rows), "Dataset": datasets.Dataset.from_list(rows)}


@pytest.fixture(scope="module")
def from_file(tmp_path_factory, tiny_model_dir):
    """The rows scored from a JSONL file of them, in memory and through a run folder."""
    root = tmp_path_factory.mktemp("file")
    data = _jsonl(root / "d.jsonl", ROWS)
    return {None: gradspec.score(data, tiny_model_dir, progress=False),
            "out": gradspec.score(data, tiny_model_dir, root / "s.parquet", progress=False)}


@pytest.mark.parametrize("kind", ["list", "DataFrame", "Dataset"])
@pytest.mark.parametrize("out", [None, "out"])
def test_rows_in_memory_score_as_the_same_rows_in_a_file(tmp_path, tiny_model_dir, from_file, kind, out):
    rows = _kinds(ROWS)[kind]
    got = gradspec.score(rows, tiny_model_dir, tmp_path / "s.parquet" if out else None, progress=False)
    pd.testing.assert_frame_equal(got, from_file[out])
    assert got["source"].tolist() == [r["source"] for r in ROWS]  # carried columns too


def test_a_run_of_rows_in_memory_records_their_hash_and_resumes_with_the_same_rows_only(tmp_path, tiny_model_dir,
                                                                                     from_file, monkeypatch, capsys):
    out = tmp_path / "s.parquet"
    written = RunFolder.write_part

    def stop_after_the_first_part(self, chunk, rows, metadata):
        written(self, chunk, rows, metadata)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunFolder, "write_part", stop_after_the_first_part)
    with pytest.raises(KeyboardInterrupt):
        gradspec.score(ROWS, tiny_model_dir, out, chunk_rows=2, progress=False)
    monkeypatch.undo()
    manifest = RunFolder(out).manifest()
    assert is_label(manifest["data"]) and manifest["data"].startswith("<in-memory: 5 rows, sha256 ")
    assert manifest["data_bytes"] is None and ROWS[0]["instruction"] not in json.dumps(manifest)  # a hash, not rows
    other = [*ROWS[:4], {**ROWS[4], "output": "3, 2, 1"}]
    with pytest.raises(OptionError, match=r"its config differs: data: '<in-memory: 5 rows, sha256 [0-9a-f]{16}>' "
                                          r"in the run, '<in-memory: 5 rows, sha256 [0-9a-f]{16}>' now"):
        gradspec.score(other, tiny_model_dir, out, chunk_rows=2, resume=True, progress=False)
    resumed = gradspec.score(pd.DataFrame(ROWS), tiny_model_dir, out, chunk_rows=2, resume=True, progress=False)
    pd.testing.assert_frame_equal(resumed, from_file["out"])
    capsys.readouterr()
    assert main(["select", "--scores", str(out), "--out", str(tmp_path / "best.jsonl"), "--by", "loss",
                 "--count", "2"]) == 2
    assert f"{out} scored rows given in memory ({manifest['data']}); pass --data with a file of those rows" in \
        capsys.readouterr().err
    assert main(["select", "--scores", str(out), "--data", str(_jsonl(tmp_path / "d.jsonl", ROWS)), "--out",
                 str(tmp_path / "best.jsonl"), "--by", "loss", "--count", "2"]) == 0


def test_align_takes_data_and_task_in_memory(tmp_path, tiny_model_dir):
    data, task = _jsonl(tmp_path / "d.jsonl", ROWS), _jsonl(tmp_path / "t.jsonl", TASK)
    want = gradspec.align(data, task, tiny_model_dir, progress=False)
    for kind, rows in _kinds(ROWS).items():
        got = gradspec.align(rows, pd.DataFrame(TASK) if kind == "DataFrame" else TASK, tiny_model_dir,
                             progress=False)
        pd.testing.assert_frame_equal(got, want)


def test_rows_in_memory_are_checked_as_a_file_s_and_errors_name_the_row(tmp_path, tiny_model_dir):
    """The same layouts and checks as a file's rows (data[i] where a file names its line), the field
    mapping applied; rows that are not a list, DataFrame or Dataset are a TypeError that names them."""
    bad = [ROWS[0], {"instruction": "No answer."}, ROWS[2]]
    with pytest.raises(InputError, match=r"^data\[1\]: missing field 'output'"):
        gradspec.score(bad, tiny_model_dir, progress=False)
    with pytest.raises(InputError, match=r"^data\[2\]: expected a dict of fields, got str"):
        gradspec.score([ROWS[0], ROWS[1], "row"], tiny_model_dir, progress=False)
    with pytest.raises(InputError, match=r"^data\[1\]: expected a dict of fields, got NoneType"):
        gradspec.score([ROWS[0], None], tiny_model_dir, progress=False)
    skipped = gradspec.score(bad, tiny_model_dir, on_error="skip", progress=False)
    assert skipped["status"].tolist() == ["ok", "input_error", "ok"]
    assert skipped["error"][1] == "data[1]: missing field 'output'"
    surrogate = [ROWS[0], {"instruction": "s \ud800", "output": "r"}]  # no UTF-8 holds it: hashed, then flagged
    assert gradspec.score(surrogate, tiny_model_dir, on_error="skip", progress=False)["status"].tolist() == \
        ["ok", "input_error"]
    with pytest.raises(ValueError, match=r"task\[0\]: expected Alpaca fields 'instruction', 'output'"):
        gradspec.align(ROWS, [{"question": "?"}], tiny_model_dir, progress=False)
    renamed = [{"prompt": r["instruction"], "answer": r["output"]} for r in ROWS[:2]]
    assert gradspec.score(renamed, tiny_model_dir, fields={"instruction": "prompt", "output": "answer"},
                          progress=False)["status"].tolist() == ["ok", "ok"]
    with pytest.raises(TypeError, match="data must be a str, a pathlib.Path, a list of dicts, a pandas DataFrame, "
                                        "a datasets.Dataset or None, got dict"):
        gradspec.score(ROWS[0], tiny_model_dir, progress=False)
    with pytest.raises(OptionError, match="split, config_name and streaming apply to data read through "
                                          "datasets .* is rows given in memory"):
        gradspec.score(ROWS, tiny_model_dir, split="test", progress=False)


def test_the_rows_are_read_only_while_the_call_holds_them():
    """A label names rows only inside the call given them; after it, reading it says so (no file of that name)."""
    with holding(data=ROWS, task=None) as given:
        assert given["task"] is None
        assert [s.carried["id"] for s in read_samples(given["data"])] == [0, 1, 2, 3, 4]
    with pytest.raises(InputError, match="rows given in memory to gradspec.score or gradspec.align, read only inside "
                                         "that call"):
        list(read_samples(given["data"]))
