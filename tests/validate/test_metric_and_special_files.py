"""validate's --metric module:function checked where it is read (its signature) and at every call (an
exception, a value that is not a finite number), one line naming --metric, the retrains finished before
kept for --resume; what a stopped validate says it keeps; and a FIFO where validate, select or report
read a score or retrain file refused at once, not waited on (issue 49: D11, D5)."""

import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pytest

from gradspec.cli import main
from gradspec.options import OptionError
from gradspec.runs.score_files import write_parquet
from gradspec.validation.config import metric_function

ROWS = [{"instruction": f"Question {i}: what is {i} plus one?", "output": f"It is {i + 1}."} for i in range(6)]
METRICS = '''
import math

import numpy as np
import torch

calls = 0


def fine(model, tokenizer):
    return 0.5


def numpy_scalar(model, tokenizer):
    return np.float32(0.25)


def tensor(model, tokenizer):
    return torch.tensor(0.75)


def text(model, tokenizer):
    return "abc"


def flag(model, tokenizer):
    return True


def nan(model, tokenizer):
    return math.nan


def inf(model, tokenizer):
    return -math.inf


def nothing(model, tokenizer):
    return None


def many(model, tokenizer):
    return [0.5] * 1000


def raises(model, tokenizer):
    raise KeyError("no\\nanswer")


def offline_at_the_third(model, tokenizer):
    global calls
    calls += 1
    if calls == 3:
        raise RuntimeError("the judge is offline")
    return float(calls)


def one_argument(model):
    return 0.5
'''


@pytest.fixture
def metrics(tmp_path, monkeypatch):
    """A module of metrics, my_metrics, importable from the current folder (as --metric finds one)."""
    (tmp_path / "my_metrics.py").write_text(METRICS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_metrics", raising=False)
    return tmp_path


def _named(error: OptionError) -> str:
    return error.named({"metric": "--metric"})


@pytest.mark.parametrize(("name", "value"), [("fine", 0.5), ("numpy_scalar", 0.25), ("tensor", 0.75)])
def test_a_metric_that_returns_a_number_gives_it_as_a_float(metrics, name, value):
    got = metric_function(f"my_metrics:{name}")(None, None)
    assert type(got) is float and got == value


@pytest.mark.parametrize(("name", "message"), [
    ("text", "--metric my_metrics:text: returned 'abc' (str), not a number; validate calls it as function(model, "
             "tokenizer) after each retrain and expects a number back"),
    ("flag", "--metric my_metrics:flag: returned True (bool), not a number"),
    ("nothing", "--metric my_metrics:nothing: returned None (NoneType), not a number"),
    ("many", "--metric my_metrics:many: returned [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, ...] (list), not a number"),
    ("nan", "--metric my_metrics:nan: returned nan, not a finite number"),
    ("inf", "--metric my_metrics:inf: returned -inf, not a finite number"),
    ("raises", "--metric my_metrics:raises: raised KeyError: 'no\\nanswer'")])
def test_a_metric_that_raises_or_returns_no_finite_number_is_one_line_naming_metric(metrics, name, message):
    metric = metric_function(f"my_metrics:{name}")
    with pytest.raises(OptionError) as caught:
        metric(None, None)
    said = _named(caught.value)
    assert said.startswith(message) and "\n" not in said, said
    assert said.endswith("(the retrains finished before are kept: once it is fixed, the same command with --resume "
                         "continues)")


def _inputs(folder):
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))


def _args(model, folder, *extra):
    """3 LDS retrains of one step each."""
    return ["validate", "--model", str(model), "--data", str(folder / "train.jsonl"), "--target",
            str(folder / "task.jsonl"), "--out", str(folder / "v.parquet"), "--subsets", "3", "--max-steps", "1",
            "--batch-size", "2", "--quiet", *extra]


def test_a_metric_of_another_signature_is_refused_before_the_model_loads(tmp_path, tiny_model_dir, capsys,
                                                                        monkeypatch):
    from gradspec.validation import run

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --metric was checked")

    monkeypatch.setattr(run, "load_model", load_model)
    _inputs(tmp_path)
    assert main(_args(tiny_model_dir, tmp_path, "--metric", "os:system")) == 2
    assert capsys.readouterr().err == ("gradspec: error: --metric os:system: takes (command), but validate calls it "
                                       "as function(model, tokenizer) after each retrain and expects a number back\n")


def test_a_metric_that_fails_stops_validate_in_one_line_and_keeps_the_retrains_for_resume(metrics, tiny_model_dir,
                                                                                         capsys):
    _inputs(metrics)
    args = _args(tiny_model_dir, metrics, "--metric", "my_metrics:offline_at_the_third")
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "gradspec: error: --metric my_metrics:offline_at_the_third: raised RuntimeError: the judge is offline (the "
        "retrains finished before are kept: once it is fixed, the same command with --resume continues)\n")
    parts = metrics / "v.parquet.parts"
    assert sorted(p.name for p in parts.glob("*.parquet")) == ["00000000.parquet", "00000001.parquet"]
    assert main([*args, "--resume"]) == 0  # the judge is back (calls 4 on): the third retrain only is run
    table = pd.read_parquet(metrics / "v.parquet")
    assert table["metric"].tolist() == [1.0, 2.0, 4.0]


def _stopped(monkeypatch, capsys, argv, signal_name=None):
    """main(argv) with the command stopped as Ctrl-C (or SIGTERM: 'terminated') stops it: (code, stderr)."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt(*([signal_name] if signal_name else []))

    monkeypatch.setattr("gradspec.validation.run.retrain", stop)
    monkeypatch.setattr("gradspec.validation.report.analyse", stop)
    monkeypatch.setattr("gradspec.analysis.select.check_size", stop)
    code = main(argv)
    return code, capsys.readouterr().err


def test_a_stopped_command_says_what_it_keeps(tmp_path, monkeypatch, capsys):
    """validate keeps its finished retrains (a part each, written whole); its analysis of --runs, and select,
    keep nothing: none of them speaks of a scoring run."""
    _inputs(tmp_path)
    retrains = ["validate", "--data", str(tmp_path / "train.jsonl"), "--target", str(tmp_path / "task.jsonl"),
                "--out", str(tmp_path / "v.parquet")]
    assert _stopped(monkeypatch, capsys, retrains) == \
        (130, "gradspec: interrupted (validate keeps the retrains it finished: the same command with --resume "
              "continues them)\n")
    assert _stopped(monkeypatch, capsys, retrains, "terminated")[0] == 143
    assert _stopped(monkeypatch, capsys, ["validate", "--runs", str(tmp_path / "v.parquet")]) == \
        (130, "gradspec: interrupted\n")
    scores = tmp_path / "s.parquet"
    write_parquet(pd.DataFrame({"index": [0], "status": ["ok"], "loss": [1.0]}),
                  scores, {"parts": [], "data": str(tmp_path / "train.jsonl")})
    select = ["select", "--scores", str(scores), "--out", str(tmp_path / "o.jsonl"), "--by", "loss", "--count", "1"]
    assert _stopped(monkeypatch, capsys, select) == (130, "gradspec: interrupted\n")


# --- a FIFO where a score or retrain file goes ------------------------------------------------------------------


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "scores.parquet"
    os.mkfifo(path)
    return path


def _retrains(path):
    """A retrain file as validate --out writes it: 3 LDS subsets of a 6-row pool, 2 targets."""
    table = pa.table({"index": range(3), "kind": ["lds"] * 3, "members": [[0, 1, 2], [2, 3, 4], [1, 4, 5]],
                      "target_loss": [[1.0, 2.0], [1.5, 2.5], [1.2, 2.2]], "metric": [None] * 3})
    write_parquet(table, path, {"rows": 6, "targets": 2, "target": "task.jsonl"})
    return path


def _command(args):
    """The command line in its own process: a read of a FIFO would block it past any signal, so a timeout
    (SIGKILL) ends it and fails the test instead of hanging the suite."""
    done = subprocess.run([sys.executable, "-m", "gradspec", *args], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr


@pytest.mark.parametrize("command", ["validate --scores", "validate --runs", "select", "report"])
def test_a_fifo_given_as_a_score_or_retrain_file_is_refused_not_waited_on(tmp_path, fifo, command):
    args = {"validate --scores": ["validate", "--runs", str(_retrains(tmp_path / "v.parquet")), "--scores",
                                  f"{fifo}:loss"],
            "validate --runs": ["validate", "--runs", str(fifo)],
            "select": ["select", "--scores", str(fifo), "--out", str(tmp_path / "o.jsonl"), "--by", "loss",
                       "--count", "1"],
            "report": ["report", f"a={fifo}", "--out", str(tmp_path / "report")]}[command]
    code, err = _command(args)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"gradspec: error: {fifo}: a FIFO (named pipe), not a regular file; pass a ")


@pytest.mark.parametrize("option", ["--outcome", "--scores"])
def test_a_fifo_given_to_a_retraining_validate_is_refused_before_the_model_loads(tmp_path, fifo, option, capsys,
                                                                                 monkeypatch):
    from gradspec.validation import run

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the score files were checked")

    monkeypatch.setattr(run, "load_model", load_model)
    _inputs(tmp_path)
    assert main(["validate", "--data", str(tmp_path / "train.jsonl"), "--target", str(tmp_path / "task.jsonl"),
                 "--out", str(tmp_path / "v.parquet"), option, f"{fifo}:loss"]) == 2
    assert capsys.readouterr().err == (f"gradspec: error: {option} {fifo}:loss: a FIFO (named pipe), not a regular "
                                       "file; pass a score file\n")

