"""--config: options from YAML or JSON, flags over the file, and a run's record replayed."""

import json
from collections import Counter

import pandas as pd
import pytest

from gradspec.cli import main
from gradspec.data.readers import Fields, Hub
from gradspec.runs import scoring
from gradspec.runs.config import ScoreConfig

ROWS = [{"q": f"Task {i}: repeat {w}", "a": f"{w} " * (i + 2)} for i, w in enumerate(["a", "b", "c"])]


@pytest.fixture
def started(monkeypatch):
    """The config each scoring run is started with (nothing runs)."""
    seen = []

    def run_scoring(config, out, **settings):
        seen.append((config, out, settings))
        return Counter()

    monkeypatch.setattr(scoring, "run", run_scoring)  # imported by the command when it runs
    return seen


def test_yaml_options_and_flags_over_them(tmp_path, started):
    (tmp_path / "run.yaml").write_text(
        "data: d.jsonl\nmax-length: 64\nmodules: q,k\ninstruction_field: q\noutput-field: a\nclassic: true\n"
        "no-merge: true\nsplit: test\nbatch_tokens: 512\n")
    assert main(["score", "--config", str(tmp_path / "run.yaml"), "--max-length", "32", "--out", "o.parquet"]) == 0
    config, out, settings = started[-1]
    assert (config.data, config.max_length, config.modules, config.classic) == ("d.jsonl", 32, "q,k", True)
    assert config.fields == Fields(instruction="q", output="a") and config.hub == Hub("test")
    assert out == "o.parquet" and settings["merge"] is False and settings["batch_tokens"] == 512
    (tmp_path / "run.json").write_text(json.dumps({"limit": 2, "precision": "fp32"}))
    assert main(["align", "--config", str(tmp_path / "run.json"), "--target", "t.jsonl"]) == 0
    config, _, _ = started[-1]
    assert (config.limit, config.precision, config.task, config.spectra) == (2, "fp32", "t.jsonl", False)


@pytest.mark.parametrize(("text", "message"), [
    ("nope: 1\n", "'nope' is not an option of gradspec score"),
    ("max_length: long\n", "max_length: expected int, got 'long'"),
    ("template: fancy\n", "template: 'fancy' is not one of plain, chat"),
    ("classic: 3\n", "classic: expected true or false, got 3"),
    ("max_length: null\n", "max_length: expected a value, got null (leave the key out for the default, 2048)"),
    ("instruction-field: null\n", "instruction-field: expected a value, got null"),
    ("modules: [q, k]\n", "modules: expected a single value, got ['q', 'k']"),
    ("- a list\n", "expected a mapping of option names to values, got list"),
    ("data: [unclosed\n", "malformed YAML"),
])
def test_config_mistakes_are_named(tmp_path, capsys, started, text, message):
    (tmp_path / "run.yaml").write_text(text)
    assert main(["score", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"gradspec: error: --config {tmp_path / 'run.yaml'}" in err and message in err and not started


def test_a_record_edited_by_hand_is_named(tmp_path, capsys, started):
    record = ScoreConfig().describe()
    (tmp_path / "manifest.json").write_text(json.dumps({**record, "max_length": "32"}))
    assert main(["score", "--config", str(tmp_path / "manifest.json")]) == 2
    assert f"--config {tmp_path / 'manifest.json'}: not a run's record as gradspec writes it: max_length must be " \
           "an int, got str '32'" in capsys.readouterr().err and not started


@pytest.mark.parametrize("config", [
    ScoreConfig(),
    ScoreConfig(data="d.jsonl", model="m", template="chat", modules="all", max_length=128, dtype="bfloat16",
                method="lowrank", rank=8, seed=3, classic=True, save_spectra=True, fields=Fields(instruction="q"),
                limit=5, chunk_rows=7, precision="fp32"),
    ScoreConfig(data="org/name", task="t.jsonl", aggregate="max", spectra=False, hub=Hub("test", "main", True)),
    ScoreConfig(project=16, seed=4),
])
def test_a_manifest_gives_back_its_config(config):
    assert ScoreConfig.from_manifest(json.loads(json.dumps(config.describe()))) == config


def test_a_run_replays_from_its_file_and_its_manifest(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    first = tmp_path / "first.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(first), "--quiet",
                 "--instruction-field", "q", "--output-field", "a", "--max-length", "24", "--modules", "v,o"]) == 0
    again = tmp_path / "again.parquet"
    assert main(["score", "--config", str(first), "--out", str(again), "--quiet"]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(first), pd.read_parquet(again))
    parts = tmp_path / "parts.parquet"
    assert main(["score", "--config", str(first), "--out", str(parts), "--quiet", "--no-merge"]) == 0
    replay = tmp_path / "replay.parquet"
    assert main(["score", "--config", str(tmp_path / "parts.parquet.parts/manifest.json"), "--out", str(replay),
                 "--quiet"]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(first), pd.read_parquet(replay))
    capsys.readouterr()
    aligned = tmp_path / "aligned.parquet"
    assert main(["align", "--config", str(first), "--target", str(data), "--out", str(aligned), "--quiet"]) == 0
    assert main(["score", "--config", str(aligned), "--out", str(tmp_path / "x.parquet")]) == 2
    assert "'target' is not an option of gradspec score (this run's record is another command's" \
        in capsys.readouterr().err


def test_a_run_with_a_relative_model_replays_from_another_folder(tmp_path, tiny_model_dir, monkeypatch):
    """The record names the model as typed (models/tiny, relative to where the run started) and the
    folder it resolved to: a replay from elsewhere loads that folder, and scores the same rows."""
    import shutil

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, start / "models" / "tiny")
    elsewhere.mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.chdir(start)
    first = tmp_path / "first.parquet"
    assert main(["score", "--model", "models/tiny", "--data", str(data), "--out", str(first), "--quiet",
                 "--instruction-field", "q", "--output-field", "a", "--max-length", "24", "--modules", "v"]) == 0
    monkeypatch.chdir(elsewhere)
    again = tmp_path / "again.parquet"
    assert main(["score", "--config", str(first), "--out", str(again), "--quiet"]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(first), pd.read_parquet(again))
