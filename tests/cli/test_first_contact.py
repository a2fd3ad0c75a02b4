"""What a newcomer sees on the first mistakes: one line that says what is wrong and what to do,
before anything slow (the model, the data) loads."""

import json
import subprocess
import sys

import pytest
import torch

from gradspec.cli import main
from gradspec.runs import scoring


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading the model is an error here: every check must come first."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(scoring, "load_model", load_model)


def _error(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradspec: error: ") and "\n" not in err, err
    return err.removeprefix("gradspec: error: ")


def test_cuda_on_a_cpu_only_torch(monkeypatch, capsys, tmp_path, nothing_loads):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    err = _error(capsys, "score", "--device", "cuda", "--out", str(tmp_path / "s.parquet"))
    assert err == (f"--device cuda: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of "
                   "torch (https://pytorch.org/get-started/locally/) or use --device cpu")


def test_cuda_without_a_visible_device(monkeypatch, capsys, tmp_path, nothing_loads):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    err = _error(capsys, "score", "--device", "cuda:0", "--out", str(tmp_path / "s.parquet"))
    assert err == ("--device cuda:0: torch sees no CUDA device (no driver, or CUDA_VISIBLE_DEVICES=''); "
                   "check nvidia-smi or use --device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _error(capsys, "score", "--device", "cuda:3", "--out", str(tmp_path / "s.parquet"))
    assert err == "--device cuda:3: only 1 CUDA device(s) visible (cuda:0 to cuda:0)"
    assert _error(capsys, "score", "--device", "gpu", "--out", str(tmp_path / "s.parquet")) == \
        "--device 'gpu': expected cpu, cuda or cuda:N"


def test_a_model_that_is_neither_a_folder_nor_a_hub_id(capsys, tmp_path, nothing_loads):
    out = str(tmp_path / "s.parquet")
    assert _error(capsys, "score", "--model", "/nonexistent", "--out", out) == \
        "--model /nonexistent: no such folder, and not a Hub model id (org/name) either"
    (tmp_path / "weights.bin").write_bytes(b"")
    assert _error(capsys, "score", "--model", str(tmp_path / "weights.bin"), "--out", out) == \
        (f"--model {tmp_path / 'weights.bin'}: a file; pass the folder that holds its config.json and weights "
         "(save_pretrained's), or a Hub model id (org/name)")
    (tmp_path / "empty").mkdir()
    assert _error(capsys, "score", "--model", str(tmp_path / "empty"), "--out", out) == \
        (f"--model {tmp_path / 'empty'}: no config.json (nor a PEFT adapter_config.json) in this folder; pass a "
         "folder written by save_pretrained, or a Hub model id (org/name)")


def test_an_existing_out_is_refused_before_loading(capsys, tmp_path, nothing_loads):
    out = tmp_path / "s.parquet"
    out.write_bytes(b"old")
    assert _error(capsys, "score", "--out", str(out)) == f"{out} exists; pass --overwrite or choose another --out"
    parts = tmp_path / "t.parquet.parts"
    parts.mkdir()
    (parts / "manifest.json").write_text(json.dumps({"data": "humaneval"}))
    assert _error(capsys, "score", "--out", str(tmp_path / "t.parquet")) == \
        f"{parts} holds an unfinished run (0 parts done); pass --resume to continue it or --overwrite to start again"
    assert out.read_bytes() == b"old"


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-length", "0"], "--max-length must be at least 1, got 0"),
    (["--chunk-rows", "0"], "--chunk-rows must be at least 1, got 0"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--batch-tokens", "-5"], "--batch-tokens must be at least 1, got -5"),
    (["--method", "lowrank", "--rank", "0"], "--rank must be at least 1, got 0"),
    (["--data", "missing.jsonl"], "--data missing.jsonl: no such file or folder (nor a Hub dataset name: org/name)"),
])
def test_impossible_options_before_loading(capsys, tmp_path, nothing_loads, flags, message):
    assert _error(capsys, "score", "--out", str(tmp_path / "s.parquet"), *flags) == message


def test_hub_options_on_a_local_file(capsys, tmp_path, nothing_loads):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    assert _error(capsys, "score", "--data", str(data), "--split", "test", "--out", str(tmp_path / "s.parquet")) == \
        (f"--split, --config-name and --streaming apply to data read through datasets (a Hub name or a folder); "
         f"{data} is a file")


def test_a_hub_model_without_a_network_is_looked_for_in_the_cache_alone(monkeypatch, capsys, tmp_path,
                                                                        nothing_loads):
    """Without a connection the Hub library retries for half a minute, then prints a paragraph."""
    import huggingface_hub.constants as hub_constants

    from gradspec.data import hub

    for name in hub._PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)

    def no_network(address, timeout=None):
        raise OSError("Name or service not known")

    monkeypatch.setattr(hub.socket, "create_connection", no_network)
    err = _error(capsys, "score", "--model", "nobody/no-model", "--limit", "1", "--out", str(tmp_path / "s.parquet"))
    assert err == ("--model nobody/no-model: no such folder here; as a Hub model id it is not in the local cache, "
                   "and the Hub is not reachable from this machine to fetch it")
    assert not (tmp_path / "s.parquet.parts").exists()


def test_a_model_folder_that_cannot_load(capsys, tmp_path, tiny_model_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    err = _error(capsys, "score", "--model", str(broken), "--limit", "1", "--out", str(tmp_path / "s.parquet"))
    assert err.startswith(f"cannot load model '{broken}' (folder): its weights: SafetensorError: ")
    bare = tmp_path / "bare"  # a config without its tokenizer
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare)
    assert _error(capsys, "score", "--model", str(bare), "--out", str(tmp_path / "s.parquet")) == \
        (f"--model {bare}: no tokenizer in this folder (tokenizer.json, tokenizer_config.json, ...); save the "
         "tokenizer beside the model: tokenizer.save_pretrained(folder)")


@pytest.mark.parametrize(("argv", "message"), [
    (["score", "--limit", "abc"], "argument --limit: invalid int value: 'abc'; see gradspec score -h"),
    (["score", "--modle", "m"], "unrecognized arguments: --modle m (--modle: did you mean --model?); see gradspec "
                                "score -h"),
    (["select", "--scores", "s.parquet"], "the following arguments are required: --out, --by; see gradspec select -h"),
    (["scor"], "argument command: invalid choice: 'scor' (did you mean score? choose from score, ray-score, align, "
               "project, select, report, merge, train, dynamics, diagnose, validate, env); see gradspec -h"),
    (["sel", "--out", "x"], "argument command: invalid choice: 'sel' (choose from score, ray-score, align, project, "
                            "select, report, merge, train, dynamics, diagnose, validate, env); see gradspec -h"),
])
def test_argument_errors_are_one_line_too(capsys, nothing_loads, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"gradspec: error: {message}\n"


def test_a_bad_target_is_found_before_loading(capsys, tmp_path, nothing_loads):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "Say a", "output": "a"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    base = ["align", "--data", str(data), "--out", str(tmp_path / "a.parquet"), "--target"]
    assert _error(capsys, *base, str(tmp_path / "empty.jsonl")) == f"--target {tmp_path / 'empty.jsonl'}: no rows"
    assert _error(capsys, *base, str(tmp_path / "bad.jsonl")).startswith(f"{tmp_path / 'bad.jsonl'}:1: malformed JSON")


def test_small_mistakes_say_what_to_pass(capsys, tmp_path, nothing_loads):
    assert _error(capsys, "merge", "--out", str(tmp_path / "d.jsonl")) == \
        f"--out {tmp_path / 'd.jsonl'}: pass the .parquet --out the run was given"
    assert _error(capsys, "score", "--config", str(tmp_path)) == \
        f"--config {tmp_path}: a folder, not a regular file; pass a YAML or JSON file, a run's manifest.json or a " \
        "score file"


@pytest.mark.parametrize("argv,meant", [(["score", "--output", "x.parquet"], "--out or --output-field"),
                                        (["score", "--dat", "d.jsonl"], "--data"),
                                        (["align", "--targ", "t.jsonl"], "--target")])
def test_an_option_is_never_abbreviated_and_a_near_miss_says_what_it_may_mean(capsys, argv, meant):
    """argparse took --output for --output-field and --dat for --data: a prefix guesses, so it is refused, with
    the options it may have meant."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and capsys.readouterr().err == f"gradspec: error: unrecognized arguments: " \
        f"{' '.join(argv[1:])} ({argv[1]}: did you mean {meant}?); see gradspec {argv[0]} -h\n"


@pytest.mark.parametrize("argv", [["score", "--bogus"], ["align", "--modle", "m"], ["project", "--k", "x"], ["scor"],
                                  ["trian", "--epochs", "1"], ["score", "--modules", "atn"],
                                  ["align", "--aggregate", "meen", "--target", "t.jsonl"]])
def test_an_argument_error_comes_before_torch_loads(argv):
    """A mistyped option of a scoring command, a mistyped command, a near miss of a --modules preset or an
    unknown --aggregate is named at once: 2.4 s of imports (torch, pandas, SciPy) came before it, which the
    parser never needed (gradspec.choices)."""
    code = (f"import sys\nfrom gradspec.cli import main\ntry:\n    code = main({argv!r})\nexcept SystemExit as e:\n"
            "    code = e.code\n"
            "print(code, sorted(m for m in ('torch', 'pandas', 'scipy', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
