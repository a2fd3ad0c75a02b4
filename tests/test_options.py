"""One source per option: a field declared with ``option()`` is the Python keyword, the CLI flag, the
config-file key and the manifest entry, and errors name it as each caller does."""

import argparse
import dataclasses
import inspect
import json

import pytest

import gradspec
from gradspec.cli import COMMANDS, main
from gradspec.cli import score as score_cli
from gradspec.cli.config_file import config_values, run_options
from gradspec.cli.options import add_options, options_from_args
from gradspec.data.shared_options import Reading
from gradspec.diagnose.thresholds import Thresholds
from gradspec.options import OptionError, declared, expose, option, split_options
from gradspec.runs.config import RunSettings, ScoreConfig
from gradspec.training.train import TrainConfig, check


@dataclasses.dataclass(frozen=True, kw_only=True)
class TemperedConfig(ScoreConfig):
    """A config with one option more, as a new option would be added."""

    temperature: float = option(1.0, "softmax temperature of the loss", kind="float", at_least=0)


def _parser(config: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradspec score")
    score_cli.add_run_arguments(parser, "scores.parquet", skip=("task", "aggregate", "spectra", "project"))
    add_options(parser, config, skip={d.name for d in declared(ScoreConfig)})  # only what the subclass adds
    return parser


def test_an_added_field_is_a_flag_a_config_key_a_manifest_entry_and_a_keyword(tmp_path):
    parser = _parser(TemperedConfig)
    assert "--temperature" in parser.format_help() and "softmax temperature" in parser.format_help()
    args = parser.parse_args(["--temperature", "2", "--max-length", "64"])
    config = TemperedConfig(**options_from_args(TemperedConfig, args))
    assert (config.temperature, config.max_length) == (2.0, 64)

    (tmp_path / "run.yaml").write_text("temperature: 0.5\n")
    assert config_values(tmp_path / "run.yaml", parser, "score") == {"temperature": 0.5}

    described = json.loads(json.dumps(config.describe()))
    assert described["temperature"] == 2.0
    assert TemperedConfig.from_manifest(described) == config
    assert run_options(config, described.keys())["temperature"] == 2.0  # a run replayed gives it back

    given, settings = split_options({"temperature": 3, "device": "cpu"}, TemperedConfig, RunSettings, caller="score")
    assert given == {"temperature": 3} and settings == {"device": "cpu"}
    def scored(data=None, **options):
        """Scores."""

    expose(scored, TemperedConfig, RunSettings)
    assert "temperature" in inspect.signature(scored).parameters
    assert "temperature: softmax temperature of the loss (default: 1.0)" in scored.__doc__
    with pytest.raises(TypeError, match="^temperature must be a number, got str 'hot'$"):
        TemperedConfig(temperature="hot")
    with pytest.raises(OptionError, match="^temperature must be at least 0, got -1.0$"):
        TemperedConfig(temperature=-1)


def test_score_and_align_route_each_option_where_it_belongs(monkeypatch, tmp_path):
    """Each keyword reaches the config (what is computed) or the run settings (how), and align's own
    defaults differ where they should; the signature and docstring list them all."""
    from gradspec.runs import api

    started = []
    monkeypatch.setattr(api, "run", lambda config, out, **settings: started.append((config, out, settings)))
    monkeypatch.setattr(api, "read_scores", lambda out: (None, None))
    gradspec.score("d.jsonl", out=tmp_path / "s.parquet", max_length=64, fields={"output": "answer"},
                   config_name="main", batch_tokens=512, progress=False, on_error="skip")
    config, out, settings = started[-1]
    assert (config.data, config.max_length, config.fields.output, config.hub.name) == ("d.jsonl", 64, "answer", "main")
    assert out == str(tmp_path / "s.parquet")
    assert (settings["batch_tokens"], settings["progress"], settings["on_error"]) == (512, False, "skip")
    gradspec.align("d.jsonl", "t.jsonl", out=tmp_path / "a.parquet", aggregate=["max"])
    config, _, _ = started[-1]
    assert (config.task, config.aggregate, config.spectra) == ("t.jsonl", "max", False)
    parameters = inspect.signature(gradspec.score).parameters
    assert [p for p in parameters if p not in ("data", "model", "out")] == \
        [d.name for cls in (ScoreConfig, RunSettings) for d in declared(cls, python=True) if d.name not in
         ("data", "model")]
    assert "    max_length: tokens per sample at most" in gradspec.score.__doc__


@pytest.mark.parametrize(("command", "own"), [
    ("score", set()), ("align", {"store", "top"}), ("project", {"index"}),
])
def test_a_run_command_has_no_flag_but_the_declared_ones(command, own):
    """Every flag of a scoring command is a declared option, but the run folder's own (and align's store and top,
    project's index)."""
    parser = argparse.ArgumentParser()
    COMMANDS[command].add_parser(parser.add_subparsers())
    dests = {a.dest for a in parser._subparsers._group_actions[0].choices[command]._actions}
    declared_names = {d.name for d in [*declared(ScoreConfig), *declared(RunSettings)]}
    assert dests - declared_names == {"help", "config", "out", "shard", "merge"} | own


def test_train_flags_come_from_its_config():
    parser = argparse.ArgumentParser()
    COMMANDS["train"].add_parser(parser.add_subparsers())
    train = parser._subparsers._group_actions[0].choices["train"]
    assert {a.dest for a in train._actions} - {"help"} == {d.name for d in declared(TrainConfig)}


def test_an_unknown_keyword_names_the_nearest():
    with pytest.raises(TypeError, match=r"score\(\) got an unexpected keyword argument 'max_lenght' "
                                        r"\(did you mean 'max_length'\?\)"):
        gradspec.score(max_lenght=3)


def test_errors_name_options_as_the_caller_does(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "Say hi.", "output": "Hi."}) + "\n")
    with pytest.raises(OptionError, match=f"^task {tmp_path / 'nope.jsonl'}: no such file or folder"):
        gradspec.align(data, tmp_path / "nope.jsonl", progress=False)
    assert main(["align", "--data", str(data), "--target", str(tmp_path / "nope.jsonl")]) == 2
    assert f"gradspec: error: --target {tmp_path / 'nope.jsonl'}: no such file or folder" in capsys.readouterr().err
    assert main(["project", "--data", str(data), "--k", "0"]) == 2
    assert "gradspec: error: --k must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(OptionError, match="^split, config_name and streaming apply to data read through datasets"):
        gradspec.score(data, split="test", progress=False)
    assert main(["score", "--data", str(data), "--split", "test"]) == 2
    assert "gradspec: error: --split, --config-name and --streaming apply to" in capsys.readouterr().err

    (tmp_path / "run" / "model").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="pass overwrite to replace them or choose another out$"):
        check(TrainConfig(out=str(tmp_path / "run")))
    assert main(["train", "--out", str(tmp_path / "run")]) == 2
    assert "pass --overwrite to replace them or choose another --out" in capsys.readouterr().err


def test_diagnose_thresholds_are_declared_options(capsys):
    parser = argparse.ArgumentParser()
    COMMANDS["diagnose"].add_parser(parser.add_subparsers())
    diagnose = parser._subparsers._group_actions[0].choices["diagnose"]
    assert {d.name for d in declared(Thresholds)} <= {a.dest for a in diagnose._actions}
    with pytest.raises(OptionError, match="^conflict_share must be between 0 and 1, got 2.0$"):
        Thresholds(conflict_share=2)
    assert main(["diagnose", "--base", "b", "--model", "m", "--data", "d.jsonl", "--conflict-share", "2"]) == 2
    assert "gradspec: error: --conflict-share must be between 0 and 1, got 2.0" in capsys.readouterr().err


def test_a_js_threshold_no_divergence_reaches_is_refused():
    """The Jensen-Shannon divergence in nats is at most ln 2: a threshold above would never flag a conflict."""
    assert Thresholds(js_threshold=0.69).js_threshold == 0.69
    with pytest.raises(OptionError, match="^js_threshold must be between 0 and 0.693147, got 0.7$"):
        Thresholds(js_threshold=0.7)


@pytest.mark.parametrize(("command", "classes", "own"), [
    ("diagnose", (Reading, Thresholds), {"base", "model", "data", "checkpoints", "dynamics", "scores", "out",
                                         "overwrite", "progress"}),
    ("dynamics", (Reading,), {"checkpoints", "data", "out", "overwrite", "progress", "learned_accuracy"}),
])
def test_commands_that_read_data_take_the_shared_options(command, classes, own):
    parser = argparse.ArgumentParser()
    COMMANDS[command].add_parser(parser.add_subparsers())
    dests = {a.dest for a in parser._subparsers._group_actions[0].choices[command]._actions} - {"help"}
    assert dests == own | {d.name for cls in classes for d in declared(cls)}


def test_an_option_error_survives_pickling_and_a_nan_is_no_number():
    """torchrun's ranks share one rank's error pickled; NaN passes every comparison, so it is refused."""
    import pickle

    from gradspec.options import OptionExists, mention

    error = pickle.loads(pickle.dumps(OptionExists("out", f"x exists; pass {mention('overwrite')}")))
    assert isinstance(error, FileExistsError) and error.named({"out": "--out", "overwrite": "--overwrite"}) == \
        "--out x exists; pass --overwrite"
    with pytest.raises(OptionError, match="^conflict_share must be a finite number, got nan$"):
        Thresholds(conflict_share=float("nan"))
    with pytest.raises(OptionError, match="^learning_rate must be a finite number, got inf$"):
        TrainConfig(learning_rate=float("inf"))
