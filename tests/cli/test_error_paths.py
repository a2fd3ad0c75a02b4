"""Every command's error paths, as a new user meets them: one line that says what is wrong and what
to do, and nothing already there (an input, a finished file) lost."""

import json

import pytest

from gradspec.cli import main

ROWS = [{"instruction": f"Task {i}: repeat {w}", "output": f"{w} " * (i + 2)} for i, w in enumerate("abcd")]


def _error(capsys, *argv):
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradspec: error: ") and "\n" not in err, err
    return err.removeprefix("gradspec: error: ")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    """A scored JSONL of four rows, a store, and an align file without spectra."""
    root = tmp_path_factory.mktemp("errors")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = ["--model", str(tiny_model_dir), "--data", str(data), "--quiet"]
    assert main(["score", *common, "--out", str(root / "s.parquet")]) == 0
    assert main(["project", *common, "--k", "2", "--out", str(root / "store.parquet")]) == 0
    assert main(["align", *common, "--target", str(data), "--out", str(root / "a.parquet")]) == 0
    return root


@pytest.mark.parametrize(("flags", "message"), [
    (["--fraction", "1.5"], "--fraction must be in (0, 1], got 1.5"),
    (["--count", "0"], "--count must be at least 1, got 0"),
    (["--count", "1", "--length-buckets", "-1"], "--length-buckets must be 0 (none) or more, got -1"),
    (["--fraction", "0.1"], "--fraction 0.1 of 4 complete rows selects none; ask for more"),
    (["--fraction", "0.1", "--length-buckets", "4"], "--fraction 0.1 of 4 complete rows selects none; ask for more"),
])
def test_select_sizes(run, capsys, flags, message):
    by = [] if "--by" in flags else ["--by", "effective_rank"]
    assert _error(capsys, "select", "--scores", run / "s.parquet", "--out", run / "o.jsonl", *by, *flags) == message


def test_select_never_overwrites_its_input_or_an_existing_file(run, capsys):
    before = (run / "d.jsonl").read_text()
    assert _error(capsys, "select", "--scores", run / "s.parquet", "--out", run / "d.jsonl", "--by", "loss",
                  "--count", "1", "--overwrite") == \
        f"--out {run / 'd.jsonl'} is the scored input itself; choose another path"
    assert (run / "d.jsonl").read_text() == before
    (run / "old.jsonl").write_text("keep\n")
    assert _error(capsys, "select", "--scores", run / "s.parquet", "--out", run / "old.jsonl", "--by", "loss",
                  "--count", "1") == f"{run / 'old.jsonl'} exists; pass --overwrite or choose another --out"
    assert (run / "old.jsonl").read_text() == "keep\n"


@pytest.mark.parametrize("command", ["select", "report"])
def test_a_score_file_that_is_not_one(run, capsys, tmp_path, command):
    what = "pass a score file (the --out of gradspec score, align or project)"
    (tmp_path / "folder").mkdir()
    cases = {tmp_path / "missing.parquet": "no such file",
             run / "d.jsonl": "not a readable Parquet file (Parquet magic bytes not found in footer. Either the file "
                              "is corrupted or this is not a parquet file.)",
             tmp_path / "folder": "a folder, not a Parquet file"}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    cases[tmp_path / "other.parquet"] = "no 'status' column, so not a gradspec score file"
    for path, problem in cases.items():
        argv = (["select", "--scores", path, "--data", run / "d.jsonl", "--out", tmp_path / "o.jsonl", "--by", "loss",
                 "--count", "1"] if command == "select" else ["report", f"a={run / 's.parquet'}", f"b={path}",
                                                              "--out", tmp_path / "r"])
        assert _error(capsys, *argv) == f"{path}: {problem}; {what}"
    assert not (tmp_path / "r").exists()  # report checks every input before it makes its folder


def test_report_needs_spectra_and_distinct_labels(run, capsys, tmp_path):
    for name in ("store.parquet", "a.parquet"):
        assert _error(capsys, "report", f"a={run / 's.parquet'}", f"b={run / name}", "--out", tmp_path / "r") == \
            (f"b={run / name}: no spectral metrics (a store from gradspec project, or align without --spectra); "
             "report compares score files")
    assert _error(capsys, "report", f"a={run / 's.parquet'}", f"a={run / 's.parquet'}") == \
        "label 'a' is given twice; give each score file its own label"
    (tmp_path / "r.md").write_text("")
    assert _error(capsys, "report", f"a={run / 's.parquet'}", "--out", tmp_path / "r.md") == \
        f"--out {tmp_path / 'r.md'} is a file; a report is a folder"


def test_score_out_resume_and_empty_input(run, capsys, tmp_path, tiny_model_dir):
    model = ["--model", tiny_model_dir, "--quiet"]
    assert _error(capsys, "score", *model, "--out", tmp_path / "s.parquet", "--resume", "--overwrite") == \
        "--resume and --overwrite: the first continues a run, the second starts it again; pass one of them"
    assert _error(capsys, "score", *model, "--out", tmp_path / "s.csv") == f"--out {tmp_path / 's.csv'}: name a " \
        ".parquet file to write"
    (tmp_path / "empty.jsonl").write_text("")
    assert _error(capsys, "score", *model, "--data", tmp_path / "empty.jsonl", "--out", tmp_path / "e.parquet") == \
        f"{tmp_path / 'empty.jsonl'}: no rows to score"
    (tmp_path / "cols.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    err = _error(capsys, "score", *model, "--data", tmp_path / "cols.jsonl", "--out", tmp_path / "c.parquet")
    assert err.endswith("found ['answer', 'prompt']: name yours with --instruction-field, --output-field, "
                        "--messages-field, --conversations-field, --prompt-field or --completion-field")
    assert not (tmp_path / "c.parquet.parts").exists()  # stopped before any part: nothing left to --resume
    assert main(["score", *map(str, model), "--data", str(tmp_path / "cols.jsonl"), "--out",
                 str(tmp_path / "c.parquet"), "--instruction-field", "prompt", "--output-field", "answer"]) == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--learning-rate", "-1"], "--learning-rate must be above 0, got -1.0"),
    (["--epochs", "0"], "--epochs must be above 0, got 0.0"),
    (["--max-steps", "0"], "--max-steps must be at least 1, got 0"),
    (["--monitor-every", "0"], "--monitor-every must be at least 1, got 0"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--loss", "sftmix", "--alpha", "0"], "--alpha must be above 0, got 0.0"),
])
def test_train_options(capsys, tmp_path, flags, message):
    assert _error(capsys, "train", "--out", tmp_path / "t", *flags) == message


def test_train_and_diagnose_write_folders(capsys, tmp_path, run, tiny_model_dir):
    (tmp_path / "f").write_text("")
    assert _error(capsys, "train", "--out", tmp_path / "f") == \
        f"--out {tmp_path / 'f'} is a file; train writes a folder"
    assert _error(capsys, "diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", run / "d.jsonl",
                  "--out", tmp_path / "f") == f"--out {tmp_path / 'f'} is a file; diagnose writes a folder"


@pytest.mark.parametrize(("flags", "message"), [
    (["--distractors", "0"], "--distractors must be at least 1, got 0"),
    (["--reproduced-rouge", "2"], "--reproduced-rouge must be between 0 and 1, got 2.0"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
])
def test_diagnose_options(capsys, tmp_path, run, tiny_model_dir, flags, message):
    assert _error(capsys, "diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", run / "d.jsonl",
                  "--out", tmp_path / "d", *flags) == message


def test_diagnose_choices_are_the_parsers(capsys, tmp_path, run, tiny_model_dir):
    with pytest.raises(SystemExit) as stopped:  # argparse's own check of a declared option's choices
        main(["diagnose", "--base", str(tiny_model_dir), "--model", str(tiny_model_dir), "--data",
              str(run / "d.jsonl"), "--out", str(tmp_path / "d"), "--criterion", "foo"])
    assert stopped.value.code == 2
    assert "argument --criterion: invalid choice: 'foo' (choose from 'reproduction', 'likelihood')" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command", ["diagnose", "train"])
def test_a_dynamics_file_that_is_not_one(capsys, tmp_path, run, tiny_model_dir, command):
    what = "pass a dynamics file (from gradspec dynamics or gradspec train)"
    for path, problem in ((tmp_path / "missing.parquet", "no such file"), (run / "s.parquet", "not a dynamics file")):
        argv = (["diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", run / "d.jsonl",
                 "--dynamics", path, "--out", tmp_path / "d"] if command == "diagnose" else
                ["train", "--model", tiny_model_dir, "--data", run / "d.jsonl", "--loss", "sftmix",
                 "--reference-dynamics", path, "--out", tmp_path / "t"])
        assert _error(capsys, *argv) == f"{path}: {problem}; {what}"


def test_dynamics_options(capsys, tmp_path, run, tiny_model_dir):
    base = ["dynamics", "--checkpoints", tiny_model_dir, "--data", run / "d.jsonl", "--out", tmp_path / "dy.parquet"]
    assert _error(capsys, *base, "--limit", "0") == "--limit must be at least 1, got 0"
    assert _error(capsys, *base, "--learned-accuracy", "1.5") == "--learned-accuracy must be between 0 and 1, got 1.5"
    (tmp_path / "empty.jsonl").write_text("")
    assert _error(capsys, *base[:3], "--data", tmp_path / "empty.jsonl") == f"{tmp_path / 'empty.jsonl'}: no rows"


def test_merge_says_what_to_pass(capsys, run):
    out = run / "s.parquet"
    assert _error(capsys, "merge", "--out", f"{out}.parts") == \
        f"--out {out}.parts: pass the --out the run was given ({out}), not its .parts folder"
    assert _error(capsys, "merge", "--out", out) == f"{out} is already a merged file: nothing to merge"


def test_a_projection_larger_than_the_gradient(capsys, run, tiny_model_dir):
    """The module sizes come with the model: the one message that follows its loading."""
    assert main(["project", "--model", str(tiny_model_dir), "--data", str(run / "d.jsonl"), "--k", "100000",
                 "--out", str(run / "big.parquet")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gradspec: error: --k 100000 is more than the smallest scored module's size (32): a projection larger than "
        "the gradient itself; use --k 32 or less")


def test_resume_and_replay_say_what_to_do(capsys, run, tiny_model_dir):
    out = run / "s.parquet"
    common = ["--model", tiny_model_dir, "--data", run / "d.jsonl", "--quiet"]
    assert main(["score", *map(str, common), "--out", str(out), "--resume"]) == 0  # finished: nothing to do
    assert capsys.readouterr().out == f"{out} was already complete: nothing to resume\n"  # no "wrote": it wrote none
    assert _error(capsys, "score", *common, "--out", out, "--resume", "--max-length", "64") == \
        f"{out} is complete, but of another config: --max-length: 2048 in the file, 64 now; --overwrite scores it " \
        "again with this one"
    assert main(["score", *map(str, common), "--out", str(run / "p.parquet"), "--no-merge"]) == 0
    err = _error(capsys, "score", *common, "--out", run / "p.parquet", "--resume", "--max-length", "64")
    assert err.startswith(f"cannot continue the run in {run / 'p.parquet.parts'}, its config differs: --max-length: "
                          "2048 in the run, 64 now")
    assert err.endswith("; pass --overwrite to start again with the new config")
    assert _error(capsys, "align", *common, "--target", run / "d.jsonl", "--aggregate", "", "--out",
                  run / "x.parquet") == \
        "--aggregate takes one or more of mean_gradient, mean, max (comma-separated), got nothing"


def test_options_of_another_mode_are_refused(capsys, tmp_path, run, tiny_model_dir):
    assert _error(capsys, "train", "--alpha", "0.3", "--out", tmp_path / "t") == \
        "--alpha: only for --loss sftmix, not ntp"
    assert _error(capsys, "diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", run / "d.jsonl",
                  "--dynamics", run / "dy.parquet", "--checkpoints", tiny_model_dir, "--out", tmp_path / "d") == \
        "give --dynamics or --checkpoints, not both"
    assert _error(capsys, "dynamics", "--checkpoints", run, "--data", run / "d.jsonl") == \
        (f"--checkpoints {run}: no config.json (nor a PEFT adapter_config.json) in this folder; pass a folder "
         "written by save_pretrained, or a Hub model id (org/name)")


def test_a_score_file_is_not_training_data(capsys, run, tiny_model_dir):
    out = run / "s.parquet"
    assert _error(capsys, "score", "--model", tiny_model_dir, "--data", out, "--out", run / "y.parquet") == \
        f"--data {out}: a file gradspec wrote (scores, a store), not training data; pass the data it scored"


def test_options_without_effect_are_refused_even_at_their_defaults(capsys, tmp_path, run, tiny_model_dir):
    common = ["--model", tiny_model_dir, "--data", run / "d.jsonl", "--out", tmp_path / "x.parquet"]
    assert _error(capsys, "score", *common, "--rank", "64") == "--rank has no effect without --method lowrank; drop it"
    assert _error(capsys, "score", *common, "--seed", "0") == "--seed has no effect without --method lowrank; drop it"
    (tmp_path / "c.yaml").write_text("rank: 64\n")  # a config file's option is given too
    assert _error(capsys, "score", *common, "--config", tmp_path / "c.yaml") == \
        "--rank has no effect without --method lowrank; drop it"
    assert _error(capsys, "align", *common, "--target", run / "d.jsonl", "--backend", "cpp", "--save-spectra") == \
        "--save-spectra, --backend have no effect without the spectral metrics (add --spectra); drop them"
    assert _error(capsys, "align", "--store", run / "store.parquet", "--target", run / "d.jsonl", "--modules", "attn",
                  "--template", "plain", "--out", tmp_path / "a.parquet") == \
        "--template, --modules have no effect with --store, which holds the pool, the model and their settings; " \
        "drop them"
    assert _error(capsys, "train", "--prompt-weight", "1", "--out", tmp_path / "t") == \
        "--prompt-weight has no effect without --loss wit; drop it"
    assert not (tmp_path / "x.parquet.parts").exists() and not (tmp_path / "t").exists()


def test_select_refuses_another_input_of_the_same_length(capsys, tmp_path, run):
    other = tmp_path / "other.jsonl"  # as many rows as the scored input: rows alone would not tell them apart
    other.write_text("".join(json.dumps({"instruction": f"Other {i}", "output": "x"}) + "\n" for i in range(4)))
    size, scored = other.stat().st_size, (run / "d.jsonl").stat().st_size
    assert _error(capsys, "select", "--scores", run / "s.parquet", "--data", other, "--out", tmp_path / "o.jsonl",
                  "--by", "loss", "--count", "1") == \
        (f"{other}: {size} bytes, but the input {run / 's.parquet'} scored had {scored}: not that input, or changed "
         "since; pass the file that was scored, or score this one")
    assert not (tmp_path / "o.jsonl").exists()


def test_diagnose_needs_evidence_for_every_sample(capsys, tmp_path, run, tiny_model_dir):
    data = run / "d.jsonl"
    assert main(["dynamics", "--checkpoints", str(tiny_model_dir), "--data", str(data), "--limit", "2",
                 "--out", str(tmp_path / "dy.parquet")]) == 0
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--limit", "3", "--quiet",
                 "--out", str(tmp_path / "s3.parquet")]) == 0
    base = ["diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", data, "--out", tmp_path / "d"]
    assert _error(capsys, *base, "--dynamics", tmp_path / "dy.parquet") == (
        f"--dynamics {tmp_path / 'dy.parquet'} has no rows for 2 of the 4 samples (the first: index 2); "
        "pass the file made from this data, or a --limit it covers")
    other = tmp_path / "other.jsonl"  # scored: a file of other rows
    other.write_text("".join(json.dumps({"instruction": f"Other {i}", "output": "x"}) + "\n" for i in range(4)))
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(other), "--quiet",
                 "--out", str(tmp_path / "other.parquet")]) == 0
    assert _error(capsys, *base, "--scores", tmp_path / "other.parquet") == (
        f"{data}: {data.stat().st_size} bytes, but the input {tmp_path / 'other.parquet'} scored had "
        f"{other.stat().st_size}: not that input, or changed since; pass the file that was scored, or score this one")
    assert _error(capsys, *base, "--scores", tmp_path / "s3.parquet", "--limit", "4") == (
        f"--scores {tmp_path / 's3.parquet'} has no rows for 1 of the 4 samples (the first: index 3); "
        "pass the file made from this data, or a --limit it covers")
    assert not (tmp_path / "d").exists()


def test_select_by_what_is_not_a_score(capsys, tmp_path, run):
    base = ["select", "--scores", run / "s.parquet", "--out", tmp_path / "o.jsonl", "--count", "1", "--by"]
    assert _error(capsys, *base, "index") == "--by index: the row's position, not a score; choose a metric or a " \
                                             "numeric column"
    assert _error(capsys, *base, "status") == "--by status: the row's flags, not a score; choose a metric or a " \
                                              "numeric column"
    assert _error(capsys, *base, "index:1,loss:1") == "--by index: the row's position, not a score; choose a metric " \
                                                      "or a numeric column"
    assert _error(capsys, "select", "--scores", run / "store.parquet", "--out", tmp_path / "o.jsonl", "--count", "1",
                  "--by", "effective_rank") == \
        ("--by effective_rank: the score file has no per-module metrics (a store from gradspec project, or align "
         "without --spectra); choose a column, or score with spectra")


def test_a_dynamics_file_is_not_a_score_file(capsys, tmp_path, run, tiny_model_dir):
    dynamics = tmp_path / "dy.parquet"
    assert main(["dynamics", "--checkpoints", str(tiny_model_dir), "--data", str(run / "d.jsonl"), "--out",
                 str(dynamics)]) == 0
    what = "pass a score file (the --out of gradspec score, align or project)"
    assert _error(capsys, "select", "--scores", dynamics, "--data", run / "d.jsonl", "--out", tmp_path / "o.jsonl",
                  "--by", "loss", "--count", "1") == f"{dynamics}: a dynamics file, not a score file; {what}"
    assert _error(capsys, "diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", run / "d.jsonl",
                  "--scores", dynamics, "--out", tmp_path / "d") == \
        f"{dynamics}: a dynamics file, not a score file; {what}"


def test_report_compares_like_with_like(capsys, tmp_path, run, tiny_model_dir):
    mlp = tmp_path / "mlp.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(run / "d.jsonl"), "--modules", "mlp",
                 "--out", str(mlp), "--quiet"]) == 0
    out = tmp_path / "r"
    assert _error(capsys, "report", f"a={run / 's.parquet'}", f"b={mlp}", "--out", out) == \
        ("a scored q, k, v, o; b scored gate, up, down: a report compares files scored on the same module types; "
         "score them with the same --modules")
    assert _error(capsys, "report", f"a={run / 's.parquet'}", f"b={run / 's.parquet'}", "--out", out) == \
        f"b={run / 's.parquet'} is the same file as a={run / 's.parquet'}; compare different score files"
    assert not out.exists()
    assert main(["report", f"a={run / 's.parquet'}", "--out", str(out)]) == 0  # one group: described, not compared
    text = (out / "report.md").read_text()
    assert "Cohen's d" not in text and "**Few rows:** a (4) scored rows" in text
    assert _error(capsys, "report", f"a={run / 's.parquet'}", "--out", out) == \
        f"--out {out} is a folder that is not empty; pass --overwrite or choose another --out"
    assert main(["report", f"a={run / 's.parquet'}", "--out", str(out), "--overwrite"]) == 0


def test_train_checks_its_data_and_settings_before_loading(capsys, tmp_path, run, tiny_model_dir):
    base = ["train", "--model", tiny_model_dir, "--out", tmp_path / "t"]
    (tmp_path / "empty.jsonl").write_text("")
    assert _error(capsys, *base, "--data", tmp_path / "empty.jsonl") == \
        f"{tmp_path / 'empty.jsonl'}: 0 rows; nothing to train on"
    assert _error(capsys, *base, "--data", run / "d.jsonl", "--loss", "sftmix", "--limit", "1") == \
        f"{run / 'd.jsonl'}: 1 rows; SFTMix pairs samples: it needs 2 or more"
    assert _error(capsys, *base, "--data", run / "d.jsonl", "--loss", "sftmix", "--batch-size", "3") == \
        "--batch-size 3: SFTMix pairs a confident with an unconfident sample; give an even batch size"
    dynamics = tmp_path / "dy.parquet"
    assert main(["dynamics", "--checkpoints", str(tiny_model_dir), "--data", str(run / "d.jsonl"), "--limit", "2",
                 "--out", str(dynamics)]) == 0
    assert _error(capsys, *base, "--data", run / "d.jsonl", "--loss", "sftmix", "--reference-dynamics", dynamics) == \
        (f"--reference-dynamics {dynamics} has no rows for 2 of the 4 samples (the first: index 2); pass the file "
         "made from this data, or a --limit it covers")
    assert not (tmp_path / "t").exists()
    (tmp_path / "t" / "model").mkdir(parents=True)  # an earlier run
    assert _error(capsys, *base, "--data", run / "d.jsonl") == \
        (f"--out {tmp_path / 't'} holds an earlier run's model/; pass --overwrite to replace them or choose "
         "another --out")


def test_dynamics_and_diagnose_keep_what_exists(capsys, tmp_path, run, tiny_model_dir):
    dynamics = ["dynamics", "--checkpoints", tiny_model_dir, "--data", run / "d.jsonl"]
    (tmp_path / "dy.parquet").write_bytes(b"old")
    assert _error(capsys, *dynamics, "--out", tmp_path / "dy.parquet") == \
        f"{tmp_path / 'dy.parquet'} exists; pass --overwrite or choose another --out"
    assert (tmp_path / "dy.parquet").read_bytes() == b"old"
    assert _error(capsys, *dynamics, "--out", tmp_path / "dy.csv") == \
        f"--out {tmp_path / 'dy.csv'}: name a .parquet file to write"
    diagnose = ["diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--out", tmp_path / "dg"]
    (tmp_path / "empty.jsonl").write_text("")
    assert _error(capsys, *diagnose, "--data", tmp_path / "empty.jsonl") == f"{tmp_path / 'empty.jsonl'}: no rows"
    (tmp_path / "dg").mkdir()
    (tmp_path / "dg" / "report.md").write_text("old")
    assert _error(capsys, *diagnose, "--data", run / "d.jsonl") == \
        (f"--out {tmp_path / 'dg'} holds an earlier diagnosis (report.md); pass --overwrite or "
         "choose another --out")  # what is there, not every output a diagnosis writes


@pytest.mark.parametrize("command", ["score", "select", "report", "train", "dynamics", "diagnose"])
def test_an_out_that_cannot_be_written(capsys, tmp_path, run, tiny_model_dir, command):
    """Checked before any work: a file where a folder should be (a read-only folder, as root, is writable)."""
    (tmp_path / "f").write_text("")
    out = tmp_path / "f" / ("x.parquet" if command in ("score", "dynamics") else
                            "x.jsonl" if command == "select" else "x")
    argv = {
        "score": ["score", "--model", tiny_model_dir, "--data", run / "d.jsonl"],
        "select": ["select", "--scores", run / "s.parquet", "--by", "loss", "--count", "1"],
        "report": ["report", f"a={run / 's.parquet'}"],
        "train": ["train", "--model", tiny_model_dir, "--data", run / "d.jsonl"],
        "dynamics": ["dynamics", "--checkpoints", tiny_model_dir, "--data", run / "d.jsonl"],
        "diagnose": ["diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--data", run / "d.jsonl"],
    }[command]
    assert _error(capsys, *argv, "--out", out) == \
        f"--out {out}: {tmp_path / 'f'} is a file, not a folder; choose another --out"


def test_a_damaged_run_folder_and_a_failed_shard(capsys, tmp_path, run, tiny_model_dir):
    out = tmp_path / "s.parquet"
    (tmp_path / "s.parquet.parts").mkdir()
    (tmp_path / "s.parquet.parts" / "manifest.json").write_text("junk")
    assert _error(capsys, "merge", "--out", out) == \
        (f"{tmp_path / 's.parquet.parts' / 'manifest.json'}: not a run's manifest (Expecting value, line 1); the run's "
         "parts are intact: pass --resume to continue it (the parts of this config are kept, the manifest written "
         "again)")
    common = ["score", "--model", tiny_model_dir, "--data", run / "d.jsonl", "--out", tmp_path / "f.parquet",
              "--shard", "0/2", "--quiet"]
    assert _error(capsys, *common, "--max-length", "1") == \
        "4 of 4 rows have no response tokens (prompt_too_long 4): the prompts fill --max-length: raise it " \
        "(judged on the input's first 4 rows)"
    assert not (tmp_path / "f.parquet.parts").exists()  # so the corrected command starts afresh
    assert main([str(a) for a in common]) == 0


@pytest.mark.parametrize("command", ["dynamics", "train", "diagnose"])
def test_every_command_that_reads_data_takes_the_field_names(capsys, tmp_path, tiny_model_dir, command):
    data = tmp_path / "cols.jsonl"  # the advice names --instruction-field and --output-field: each command has them
    data.write_text("".join(json.dumps({"prompt": f"Say {w}", "answer": f"{w}."}) + "\n" for w in "abcd"))
    argv = {"dynamics": ["dynamics", "--checkpoints", tiny_model_dir, "--out", tmp_path / "dy.parquet"],
            "train": ["train", "--model", tiny_model_dir, "--out", tmp_path / "t", "--max-steps", "1"],
            "diagnose": ["diagnose", "--base", tiny_model_dir, "--model", tiny_model_dir, "--out", tmp_path / "d",
                         "--repetitions", "1"]}[command] + ["--data", data]
    assert _error(capsys, *argv).endswith("found ['answer', 'prompt']: name yours with --instruction-field, "
                                          "--output-field, --messages-field, --conversations-field, --prompt-field "
                                          "or --completion-field")
    assert main([str(a) for a in argv] + ["--instruction-field", "prompt", "--output-field", "answer"]) == 0


def test_select_from_an_input_that_moved(capsys, tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    scores = tmp_path / "s.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(scores), "--quiet"]) == 0
    data.rename(tmp_path / "moved.jsonl")
    argv = ["select", "--scores", scores, "--out", tmp_path / "o.jsonl", "--by", "loss", "--count", "1"]
    assert _error(capsys, *argv) == f"{data}, the input {scores} scored, is gone; pass --data with where it is now"
    assert main([str(a) for a in argv] + ["--data", str(tmp_path / "moved.jsonl")]) == 0


@pytest.mark.parametrize("command", ["score", "train"])
def test_a_near_miss_of_a_preset_is_named_before_the_model_loads(capsys, tmp_path, command):
    """--modules atn was reported once the model had loaded (22-30 s): now before (the model named here does not
    exist, and it is not what the error is about)."""
    out = tmp_path / ("s.parquet" if command == "score" else "run")
    assert _error(capsys, command, "--model", tmp_path / "no-model", "--modules", "q,atn", "--out", out) == \
        "--modules 'atn': no preset of that name; did you mean 'attn'? (presets: attn, mlp, experts, router, all, " \
        "lora; or roles such as q,k, or globs of part names)"
