"""Files are data, never authority: a --config file or a run's record (crafted or not) cannot turn on
remote code, choose the output or delete anything; --overwrite follows no symbolic link and deletes
only what gradspec wrote. Each case as an attacker would try it, through the real command line."""

import json
import shutil

import pytest

import gradspec
from gradspec.cli import main

EVIL = "open({marker!r}, 'w').close()\n"  # what the model folder's code would do if it ran


@pytest.fixture
def evil_model(tmp_path, tiny_model_dir):
    """A model folder whose config names code of its own (auto_map): it leaves a marker if it runs."""
    model = tmp_path / "evil-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "evil.py").write_text(EVIL.format(marker=str(tmp_path / "ran")) +
                                   "from transformers import LlamaConfig, LlamaForCausalLM\n"
                                   "class EvilConfig(LlamaConfig):\n    pass\n"
                                   "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Say {i}", "output": f"{i} " * 3}) + "\n" for i in range(3)))
    return path


def _error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1].removeprefix("gradspec: error: ")


@pytest.mark.parametrize("form", ["manifest", "yaml", "json"])
def test_a_file_cannot_turn_on_remote_code(tmp_path, evil_model, data, capsys, form):
    """S1: a manifest.json crafted beside a run (no version key: read as a plain options file), or any
    YAML or JSON options file, that sets trust_remote_code with a model whose auto_map names code."""
    options = {"model": str(evil_model), "data": str(data), "trust_remote_code": True, "quiet": True}
    if form == "manifest":
        path = tmp_path / "o.parquet.parts" / "manifest.json"
        path.parent.mkdir()
        path.write_text(json.dumps(options))
    elif form == "yaml":
        path = tmp_path / "run.yaml"
        path.write_text("".join(f"{k.replace('_', '-')}: {json.dumps(v)}\n" for k, v in options.items()))
    else:
        path = tmp_path / "run.json"
        path.write_text(json.dumps(options))
    assert main(["score", "--config", str(path), "--out", str(tmp_path / "x.parquet")]) == 2
    key = "trust-remote-code" if form == "yaml" else "trust_remote_code"
    assert _error(capsys) == (f"--config {path}: {key!r} is taken from the command line only, never from a file (a "
                              "file sets what a run computes, not where it writes, what it deletes or what code it "
                              "runs): drop it from the file and pass --trust-remote-code if you mean it")
    assert not (tmp_path / "ran").exists()


def test_the_crafted_model_runs_its_code_when_the_command_line_trusts_it(tmp_path, evil_model, data):
    """The control: the model above is a real attack, stopped only by where the option comes from."""
    main(["score", "--model", str(evil_model), "--data", str(data), "--quiet", "--trust-remote-code",
          "--out", str(tmp_path / "x.parquet")])
    assert (tmp_path / "ran").exists()


def test_a_file_cannot_choose_the_output_or_overwrite(tmp_path, tiny_model_dir, data, capsys):
    """S2: a file that sets out and overwrite to replace another file and delete its .parts folder."""
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"someone's results")
    (tmp_path / "victim.parquet.parts").mkdir()
    (tmp_path / "victim.parquet.parts" / "unrelated.txt").write_text("keep me")
    for key, value in (("out", str(victim)), ("overwrite", True)):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({"model": str(tiny_model_dir), "data": str(data), key: value}))
        assert main(["score", "--config", str(path), "--quiet", "--out", str(tmp_path / "mine.parquet")]) == 2
        assert _error(capsys).startswith(f"--config {path}: {key!r} is taken from the command line only")
    assert victim.read_bytes() == b"someone's results"
    assert (tmp_path / "victim.parquet.parts" / "unrelated.txt").read_text() == "keep me"


def test_a_replayed_record_replays_the_computation_only(tmp_path, tiny_model_dir, data, capsys):
    """A genuine run record gives its computation's options; the output and overwrite stay the command line's."""
    first = tmp_path / "first.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(first), "--quiet",
                 "--max-length", "64"]) == 0
    again = tmp_path / "again.parquet"
    assert main(["score", "--config", str(first), "--out", str(again), "--quiet"]) == 0
    assert gradspec.read_metadata(again)["max_length"] == 64
    assert main(["score", "--config", str(first), "--out", str(again), "--quiet"]) == 2  # no overwrite from the record
    assert _error(capsys) == f"{again} exists; pass --overwrite or choose another --out"


def test_overwrite_follows_no_symlinked_parts_folder(tmp_path, tiny_model_dir, data, capsys):
    """D6: `ln -s $PWD/victim o.parquet.parts`, then score --overwrite, emptied victim/."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    (victim / "00000000.parquet").write_bytes(b"named like a part")
    (tmp_path / "o.parquet.parts").symlink_to(victim, target_is_directory=True)
    args = ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "o.parquet"),
            "--quiet"]
    for extra in (["--overwrite"], ["--resume"], []):
        assert main([*args, *extra]) == 2
        assert _error(capsys) == (f"{tmp_path / 'o.parquet.parts'}: a symbolic link; gradspec writes and deletes in "
                                  "its run folders and follows no link to them: remove the link (what it points to "
                                  "is left as it is) or choose another --out")
    assert main(["merge", "--out", str(tmp_path / "o.parquet")]) == 2
    assert sorted(p.name for p in victim.iterdir()) == ["00000000.parquet", "thesis.tex"]


def test_overwrite_deletes_only_what_gradspec_wrote(tmp_path, tiny_model_dir, data, capsys):
    """A user's own files inside a real .parts folder are kept by --overwrite, as merge keeps them; a
    symlinked output is replaced as a link, its target untouched."""
    out, parts = tmp_path / "o.parquet", tmp_path / "o.parquet.parts"
    args = ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--quiet",
            "--chunk-rows", "1"]
    parts.mkdir()
    (parts / "notes.txt").write_text("mine")
    assert main([*args, "--max-length", "1"]) == 2  # refused after the folder was started: what it wrote goes
    assert sorted(p.name for p in parts.iterdir()) == ["notes.txt"]
    assert main([*args, "--no-merge", "--limit", "2"]) == 0
    (parts / "plots").mkdir()
    (parts / "plots" / "a.png").write_bytes(b"png")
    assert main([*args, "--overwrite"]) == 0
    assert sorted(p.name for p in parts.iterdir()) == ["notes.txt", "plots"] and (parts / "plots" / "a.png").exists()
    target = tmp_path / "precious.parquet"
    target.write_bytes(b"precious")
    out.unlink()
    out.symlink_to(target)
    assert main([*args, "--overwrite"]) == 0
    assert target.read_bytes() == b"precious" and not out.is_symlink() and out.stat().st_size > 0
