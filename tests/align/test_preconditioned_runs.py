"""`gradspec align --precondition kfac|ekfac|adam --attribution`: the factors fitted, written, read back
and refused where fitted otherwise; a transformers Trainer checkpoint's AdamW state read by parameter
name; the attribution column laid out over the target file's rows; the run equal to the engine."""

import json
import math
import sys

import pandas as pd
import pytest
import torch

from gradspec.alignment.adam import read_adam_state
from gradspec.alignment.kfac import KFACFactors
from gradspec.cli import main
from gradspec.data.errors import InputError
from gradspec.data.models import load_model
from gradspec.runs.checkpoint_sum import sum_over_checkpoints
from gradspec.runs.score_files import read_metadata

POOL = [
    {"instruction": "Write a haiku about rain.", "output": "Soft rain on the roof,\nquiet streets."},
    {"instruction": "What is 2+2?", "output": "4"},
    {"instruction": "Name a prime.", "output": "Seven is a prime number."},
    {"instruction": "Add 3 and 5.", "output": "3 + 5 = 8"},
]
TASK = [
    {"instruction": "What is 7+1?", "output": "8"},
    {"instruction": "Say nothing.", "output": ""},  # no response tokens: left out, NaN in the attribution
    {"instruction": "Compute 6 times 2.", "output": "6 * 2 = 12"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _align(tmp_path, model, out, *extra):
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    code = main(["align", "--data", str(pool), "--target", str(task), "--model", str(model), "--out", str(out),
                 "--max-length", "64", "--attribution", "--aggregate", "mean_gradient,mean,max", "--quiet",
                 *extra])
    assert code == 0
    return pd.read_parquet(out), read_metadata(out)


def _attribution(df) -> torch.Tensor:
    return torch.tensor([list(v) for v in df["attribution"]], dtype=torch.float64)


def test_kfac_factors_are_fitted_written_and_read_back_for_the_same_numbers(tmp_path, tiny_model_dir, monkeypatch):
    factors = tmp_path / "factors.safetensors"
    first, meta = _align(tmp_path, tiny_model_dir, tmp_path / "a.parquet", "--precondition", "kfac",
                         "--factors", str(factors))
    A = _attribution(first)
    assert A.shape == (4, 3) and torch.isnan(A[:, 1]).all() and torch.isfinite(A[:, [0, 2]]).all()
    assert meta["preconditioner"]["preconditioner"] == "kfac" and meta["preconditioner"]["damping"] == 0.1
    assert meta["preconditioner"]["fitted_on"]["data"] == str((tmp_path / "pool.jsonl").resolve())
    assert factors.is_file()

    def refit(*args, **kwargs):
        raise AssertionError("the factors file was there: nothing to fit")

    monkeypatch.setattr("gradspec.runs.preconditioning.fit_factors", refit)
    again, _ = _align(tmp_path, tiny_model_dir, tmp_path / "b.parquet", "--precondition", "kfac",
                      "--factors", str(factors))
    torch.testing.assert_close(_attribution(again), A, rtol=0, atol=0, equal_nan=True)  # bit-identical
    plain, _ = _align(tmp_path, tiny_model_dir, tmp_path / "c.parquet")
    assert not torch.allclose(_attribution(plain)[:, [0, 2]], A[:, [0, 2]])  # the preconditioner changes them


def test_factors_fitted_otherwise_or_of_another_kind_are_refused(tmp_path, tiny_model_dir, capsys):
    factors = tmp_path / "factors.safetensors"
    _align(tmp_path, tiny_model_dir, tmp_path / "a.parquet", "--precondition", "kfac", "--factors", str(factors),
           "--fit-limit", "2")
    pool, task = tmp_path / "pool.jsonl", tmp_path / "task.jsonl"
    base = ["align", "--data", str(pool), "--target", str(task), "--model", str(tiny_model_dir), "--max-length", "64",
            "--quiet", "--factors", str(factors)]
    assert main([*base, "--out", str(tmp_path / "b.parquet"), "--precondition", "kfac"]) == 2
    assert "fitted otherwise than this run fits them (limit: 2 there, None here)" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "c.parquet"), "--precondition", "ekfac", "--fit-limit", "2"]) == 2
    assert "K-FAC factors only; EK-FAC needs the eigenvalue correction" in capsys.readouterr().err
    assert not (tmp_path / "b.parquet").exists() and not (tmp_path / "c.parquet").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--precondition", "adam"], "--precondition adam reads --optimizer-state"),
    (["--damping", "0.5"], "--damping: only with --precondition kfac or ekfac"),
    (["--precondition", "kfac", "--damping", "0"], "--damping must be above 0, got 0.0"),
    (["--fit-data", "nowhere.jsonl", "--precondition", "kfac"], "nowhere.jsonl: no such file"),
])
def test_preconditioning_options_are_checked_before_the_model_loads(tmp_path, flags, message, capsys):
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    assert main(["align", "--data", str(pool), "--target", str(task), "--model", str(tmp_path / "no-model"),
                 "--out", str(tmp_path / "a.parquet"), *flags]) == 2
    assert message in capsys.readouterr().err


def _trainer_checkpoint(model_dir, tmp_path, every: int = 2):
    """Two AdamW steps of transformers' Trainer on the pool, saved as a checkpoint (and every N steps);
    the Trainer too."""
    from transformers import Trainer, TrainingArguments

    model, tokenizer = load_model(str(model_dir))
    ids = [tokenizer(r["instruction"] + " " + r["output"])["input_ids"][:16] for r in POOL]
    rows = [{"input_ids": torch.tensor(x + [0] * (16 - len(x))), "labels": torch.tensor(x + [-100] * (16 - len(x))),
             "attention_mask": torch.tensor([1] * len(x) + [0] * (16 - len(x)))} for x in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                             learning_rate=1e-3, save_strategy="steps", save_steps=every, report_to=[], use_cpu=True,
                             weight_decay=0.01, lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    return tmp_path / "run" / "checkpoint-2", trainer


def test_a_trainer_checkpoints_adam_state_is_read_by_parameter_name(tmp_path, tiny_model_dir):
    checkpoint, trainer = _trainer_checkpoint(tiny_model_dir, tmp_path)
    state = read_adam_state(checkpoint, trainer.model)
    assert state.step == 2 and state.betas == (0.9, 0.999) and state.lr == 1e-3
    live = trainer.optimizer.state
    for name, p in trainer.model.named_parameters():
        assert torch.equal(state.moments[name][0], live[p]["exp_avg"])
        assert torch.equal(state.moments[name][1], live[p]["exp_avg_sq"])
    other, _ = load_model(str(tiny_model_dir))
    other.lm_head = torch.nn.Linear(other.config.hidden_size, 7, bias=False)  # not the checkpoint's model
    with pytest.raises(ValueError, match="not this model's optimizer"):
        read_adam_state(checkpoint, other)


def test_align_with_adam_preconditioning_runs_from_a_checkpoint(tmp_path, tiny_model_dir):
    checkpoint, _ = _trainer_checkpoint(tiny_model_dir, tmp_path)
    df, meta = _align(tmp_path, checkpoint, tmp_path / "a.parquet", "--precondition", "adam",
                      "--optimizer-state", str(checkpoint))
    assert meta["preconditioner"]["preconditioner"] == "adam" and meta["preconditioner"]["step"] == 2
    A = _attribution(df)
    assert torch.isfinite(A[:, [0, 2]]).all() and torch.isnan(A[:, 1]).all()
    assert all(math.isfinite(v) for v in df["align_mean"])


def test_ekfac_runs_and_records_its_factors(tmp_path, tiny_model_dir):
    factors = tmp_path / "e.safetensors"
    _, meta = _align(tmp_path, tiny_model_dir, tmp_path / "a.parquet", "--precondition", "ekfac",
                     "--factors", str(factors))
    assert meta["preconditioner"]["factors"]["path"] == str(factors.resolve())
    assert KFACFactors.load(factors, []).kind == "ekfac"


def test_checkpoints_are_summed_with_their_learning_rates(tmp_path, tiny_model_dir):
    _trainer_checkpoint(tiny_model_dir, tmp_path, every=1)
    files = []
    for step in (1, 2):
        checkpoint = tmp_path / "run" / f"checkpoint-{step}"
        _align(tmp_path, checkpoint, tmp_path / f"a{step}.parquet", "--precondition", "adam",
               "--optimizer-state", str(checkpoint))
        files.append(tmp_path / f"a{step}.parquet")
    summed = sum_over_checkpoints(files, tmp_path / "sum.parquet")
    parts = [pd.read_parquet(f) for f in files]
    want = 1e-3 * _attribution(parts[0]) + 1e-3 * _attribution(parts[1])
    torch.testing.assert_close(_attribution(summed), want, rtol=1e-12, atol=0, equal_nan=True)
    assert summed["align_mean"].tolist() == pytest.approx((1e-3 * parts[0]["align_mean"]
                                                           + 1e-3 * parts[1]["align_mean"]).tolist())
    assert read_metadata(tmp_path / "sum.parquet")["weights"] == [1e-3, 1e-3]
    half = sum_over_checkpoints(files, tmp_path / "half.parquet", weights=[0.5, 0.0])
    torch.testing.assert_close(_attribution(half), 0.5 * _attribution(parts[0]), equal_nan=True)
    _align(tmp_path, tiny_model_dir, tmp_path / "plain.parquet")
    with pytest.raises(InputError, match="plain.parquet: no learning rate recorded"):
        sum_over_checkpoints([files[0], tmp_path / "plain.parquet"], tmp_path / "x.parquet")


def test_the_factor_fit_and_the_task_pass_show_their_progress(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """align --precondition kfac was silent for 85 s between reading its inputs and the scoring bar (the
    factor fit, then the task's pass): each pass has its bar now, by examples, and --quiet hides them.
    Bars show on a terminal only (gradspec.cli.options.shows_progress): stderr is one here."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    base = ["align", "--data", str(pool), "--target", str(task), "--model", str(tiny_model_dir), "--max-length", "64",
            "--precondition", "ekfac"]
    assert main([*base, "--out", str(tmp_path / "a.parquet")]) == 0
    err = capsys.readouterr().err
    for bar in ("fitting EK-FAC factors", "EK-FAC eigenvalues"):
        assert f"{bar}: 100%" in err and "4/4 [" in err.split(f"{bar}: 100%")[1].split("\n")[0], err
    # the task's 2 examples with response tokens (its empty answer is left out before the pass)
    assert "task gradients: 100%" in err and "2/2 [" in err.split("task gradients: 100%")[1].split("\n")[0], err
    assert main([*base, "--out", str(tmp_path / "b.parquet"), "--quiet"]) == 0
    assert "100%" not in capsys.readouterr().err
