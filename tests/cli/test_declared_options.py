"""Every command's options are declared once (gradspec.options) and its flags made from the declarations
(gradspec.cli.options.add_options); --out, --overwrite and --quiet are one declaration each
(gradspec.output_options), and every command's progress bars follow one rule (shows_progress)."""

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gradspec.cli
import gradspec.cli.options as cli_options
from gradspec.cli import COMMANDS, main
from gradspec.cli.options import shows_progress
from gradspec.options import declared
from gradspec.output_options import out_option, overwrite_option, progress_option

CLI = Path(gradspec.cli.__file__).parent
ARGPARSE_BUILDERS = {"add_argument", "add_mutually_exclusive_group", "add_argument_group"}


def test_no_flag_is_written_outside_the_option_system():
    """The flags of every command come from declarations: argparse's builders are called in
    gradspec/cli/options.py alone."""
    written = []
    for path in sorted(CLI.glob("*.py")):
        if path.name == "options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ARGPARSE_BUILDERS:
                written.append(f"{path.name}:{node.lineno} {node.func.attr}")
    assert not written, written


def _parsers(monkeypatch) -> tuple[dict[str, argparse.ArgumentParser], list[type]]:
    """Each command's parser, and the classes whose declarations add_options made flags of."""
    classes: list[type] = []

    def recording(cls, python=False):
        classes.append(cls)
        return declared(cls, python)

    monkeypatch.setattr(cli_options, "declared", recording)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for name in COMMANDS:
        COMMANDS[name].add_parser(sub)
    return dict(sub.choices), classes


def test_every_flag_of_every_command_is_a_declared_option(monkeypatch):
    parsers, classes = _parsers(monkeypatch)
    assert set(parsers) == set(COMMANDS)
    names = {d.name for cls in classes for d in declared(cls)}
    for name, parser in parsers.items():
        dests = {a.dest for a in parser._actions} - {"help"}
        assert dests and dests <= names, (name, dests - names)


def _same(field: dataclasses.Field, shared: dataclasses.Field) -> bool:
    """Made by the shared declaration: the same option but for this command's help (and default)."""
    mine, theirs = field.metadata["option"], shared.metadata["option"]
    return dataclasses.replace(mine, help="", kind="") == dataclasses.replace(theirs, help="", kind="")


def test_out_overwrite_and_quiet_are_one_declaration_each(monkeypatch):
    parsers, classes = _parsers(monkeypatch)
    seen = set()
    for cls in set(classes):
        for field in dataclasses.fields(cls):
            if field.name == "out":
                opt = field.metadata["option"]
                assert _same(field, out_option(None, "", required=opt.required)), cls
            elif field.name == "overwrite":
                assert _same(field, overwrite_option("")), cls
            elif field.name == "progress":
                assert field.metadata["option"] == progress_option().metadata["option"], cls
            else:
                continue
            seen.add(field.name)
    assert seen == {"out", "overwrite", "progress"}
    quiet = {name: next(a for a in p._actions if a.dest == "progress") for name, p in parsers.items()
             if any(a.dest == "progress" for a in p._actions)}
    assert set(quiet) == {"score", "ray-score", "align", "project", "select", "report", "merge", "validate", "train",
                          "dynamics", "diagnose"}  # every command but env, which shows no bar
    assert {(a.option_strings[0], a.help, a.default) for a in quiet.values()} == \
        {("--quiet", "no progress bar (one shows on a terminal)", True)}


class _Stderr:
    def __init__(self, terminal: bool) -> None:
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize(("terminal", "wanted", "shown"), [(True, True, True), (False, True, False),
                                                            (True, False, False), (False, False, False)])
def test_the_progress_rule(monkeypatch, terminal, wanted, shown):
    monkeypatch.setattr(sys, "stderr", _Stderr(terminal))
    assert shows_progress(wanted) is shown


ROWS = [{"instruction": f"Task {i}: repeat {w}", "output": f"{w} " * (i + 2)} for i, w in enumerate("abcd")]


@pytest.fixture(scope="module")
def parts(tmp_path_factory, tiny_model_dir):
    """A run's parts as `score --no-merge` leaves them, and its input."""
    root = tmp_path_factory.mktemp("bars")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(root / "s.parquet"),
                 "--chunk-rows", "2", "--no-merge", "--quiet", "--max-length", "32"]) == 0
    return root


@pytest.mark.parametrize(("terminal", "quiet"), [(True, False), (False, False), (True, True)])
def test_every_command_shows_its_bars_by_the_one_rule(tmp_path, tiny_model_dir, parts, capsys, monkeypatch,
                                                      terminal, quiet):
    """On a terminal bars show, elsewhere (a log, a pipe) none, and --quiet hides them on a terminal too:
    score's, merge's, select's, report's and train's (Trainer's own) alike."""
    shutil.copytree(parts, tmp_path / "run")
    data, out = tmp_path / "run" / "d.jsonl", tmp_path / "run" / "s.parquet"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    flag = ["--quiet"] if quiet else []
    commands = {
        "score": ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "x.parquet"),
                  "--max-length", "32", *flag],
        "merge": ["merge", "--out", str(out), *flag],
        "select": ["select", "--scores", str(out), "--by", "effective_rank", "--count", "2", "--out",
                   str(tmp_path / "best.jsonl"), *flag],
        "report": ["report", f"a={out}", f"b={tmp_path / 'x.parquet'}", "--out", str(tmp_path / "report"), *flag],
        "train": ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "train"),
                  "--max-steps", "1", "--batch-size", "2", "--max-length", "32", *flag],
    }
    bars = {"score": "4/4 [", "merge": f"merging {out.name}", "select": f"reading {out.name}",
            "report": "layer curves a", "train": "1/1 ["}
    for name, argv in commands.items():
        assert main(argv) == 0, name
        err = capsys.readouterr().err
        assert (bars[name] in err) is (terminal and not quiet), (name, err)
        if not terminal or quiet:  # no bar at all: transformers' own (loading weights, Trainer's) neither
            assert "%|" not in err, (name, err)


def test_transformers_bars_are_hidden_without_importing_it_first(tmp_path, tiny_model_dir, parts):
    """A command run in a process of its own whose stderr is no terminal: no bar of transformers' either
    (loading weights), though the rule was applied before transformers was imported (through Hugging
    Face's variable), and an argument error still comes before it loads."""
    data = tmp_path / "d.jsonl"
    shutil.copy(parts / "d.jsonl", data)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    proc = subprocess.run([sys.executable, "-m", "gradspec", "score", "--model", str(tiny_model_dir), "--data",
                           str(data), "--out", str(tmp_path / "s.parquet"), "--max-length", "32"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "%|" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr
