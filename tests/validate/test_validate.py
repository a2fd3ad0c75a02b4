"""gradspec validate: the LDS arithmetic, a planted case in which exact gradient inner products must
predict the retrains and a random score must not, and the retrains as a run (a killed run resumed,
shards, torchrun ranks: each gives one uninterrupted process's rows), and bad scores named."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats

from gradspec.cli import main
from gradspec.data.batching import Item, pad_batch, pad_id_of
from gradspec.data.readers import Sample
from gradspec.data.templates import tokenize
from gradspec.engine.loss import response_losses
from gradspec.validation.lds import lds, predictions
from gradspec.validation.retrain import Recipe, Retrainer
from gradspec.validation.subsets import lds_subset

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun sets per worker
TIMING = ["seconds"]  # a retrain's wall time: the one column that is not a result


pytestmark = pytest.mark.usefixtures("single_thread")


# --- the LDS arithmetic -------------------------------------------------------------------------------------------


def test_lds_of_a_small_example_by_hand():
    attribution = np.array([[1, 0], [2, 1], [0, 3], [1, np.nan]], dtype=float)  # NaN: counted as 0
    members = [[0, 1], [1, 2], [2, 3], [0, 3]]
    predicted = predictions(members, attribution)
    assert predicted.tolist() == [[3, 1], [2, 4], [1, 3], [2, 0]]
    losses = np.array([[0.1, 0.9], [0.2, 0.1], [0.4, 0.2], [0.3, 0.8]])
    # target 0: predicted ranks 4, 2.5, 1, 2.5; -loss ranks 4, 3, 1, 2 -> 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    # target 1: predicted ranks 2, 4, 3, 1; -loss ranks 1, 4, 3, 2 -> 4 / 5
    result = lds(predicted, losses, resamples=200)
    assert result.per_target == pytest.approx([3 / np.sqrt(10), 0.8])
    assert result.value == pytest.approx((3 / np.sqrt(10) + 0.8) / 2)
    for j in range(2):
        assert result.per_target[j] == pytest.approx(stats.spearmanr(predicted[:, j], -losses[:, j]).statistic)
    assert result.low <= result.value <= result.high and result.subsets == 4
    assert lds(predicted, losses, resamples=200).low == result.low  # the bootstrap is seeded


def test_a_constant_prediction_has_no_lds_and_subsets_are_reproducible():
    result = lds(np.ones((5, 1)), np.arange(5.0)[:, None], resamples=50)
    assert np.isnan(result.value)
    pool = list(range(3, 40))
    assert lds_subset(pool, 0.5, seed=7, k=2) == lds_subset(pool, 0.5, seed=7, k=2) != lds_subset(pool, 0.5, 7, 3)
    assert len(lds_subset(pool, 0.5, 7, 2)) == 18 and set(lds_subset(pool, 0.5, 7, 2)) <= set(pool)


# --- the planted case: the key evidence ---------------------------------------------------------------------------

WORDS = ("amber basalt cobalt dune ember fjord garnet harbor indigo juniper kelp lagoon meadow nectar onyx prism "
         "quartz raven saffron tundra umber velvet willow xenon yarrow zephyr").split()


def _conversation(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _gradient(model, tokenizer, tokens) -> torch.Tensor:
    """One sample's gradient of its mean response loss (gradspec's per-sample loss), flattened."""
    ids, mask, labels = pad_batch([tokens], pad_id_of(tokenizer), "cpu")
    loss = response_losses(model, ids, mask, labels)[0][0]
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def test_exact_gradient_inner_products_predict_the_retrains_and_a_random_score_does_not(tokenizer):
    """A pool of 16 rows, 4 of them near-copies of the 4 target examples (the same 8-word answer to a
    reworded question), the rest unrelated. The oracle attribution a_ij = <grad L_i, grad L_j> at the
    start weights (torch autograd, one sample at a time) must rank 16 retrains on half the pool as their
    measured target losses do (LDS clearly positive, its interval above 0); a random matrix's interval
    must cover 0. Neither holds if the retrains do not start from the same weights, measure other
    targets, or train on other rows than their subset's."""
    from conftest import tiny_model

    rng = np.random.default_rng(0)
    answers = [" ".join(rng.choice(WORDS, 8)) for _ in range(4)]
    targets = [_conversation(f"Recite code {j}.", a) for j, a in enumerate(answers)]
    pool = [_conversation(f"Please recite code {j}.", a) for j, a in enumerate(answers)]
    pool += [_conversation(f"Say something {i}.", f"{i} plus {i} makes {2 * i}, and so on.") for i in range(12)]
    pool = [pool[i] for i in np.random.default_rng(1).permutation(len(pool))]
    rows = {i: tokenize(m, tokenizer) for i, m in enumerate(pool)}
    items = [Item(Sample(j, m), tokenize(m, tokenizer)) for j, m in enumerate(targets)]
    model = tiny_model("llama")
    start = {k: v.clone() for k, v in model.state_dict().items()}

    train = torch.stack([_gradient(model, tokenizer, rows[i]) for i in range(len(pool))])
    target = torch.stack([_gradient(model, tokenizer, item.tokens) for item in items])
    oracle = (train @ target.T).double().numpy()
    members = [lds_subset(list(range(len(pool))), 0.5, seed=0, k=k) for k in range(16)]
    retrain = Retrainer(model, tokenizer, rows, items, Recipe(epochs=1, batch_size=4, learning_rate=1e-3))
    losses = np.array([retrain(m, seed=0).target_loss for m in members])

    found = lds(predictions(members, oracle), losses)
    assert found.value > 0.5 and found.low > 0.3, found
    assert (found.per_target > 0).all(), found.per_target
    chance = lds(predictions(members, np.random.default_rng(100).normal(size=oracle.shape)), losses)
    assert chance.low < 0 < chance.high and abs(chance.value) < 0.3, chance
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())  # the model left as found


# --- the retrains as a run ----------------------------------------------------------------------------------------

ROWS = [{"instruction": f"Question {i}: what is {i} plus one?",
         "output": f"It is {i + 1}, of course." + " Yes." * (i % 3)} for i in range(8)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A pool of 8 rows, 3 target examples, and a per-sample score of the pool (index, my_score)."""
    folder = tmp_path_factory.mktemp("validate")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    pd.DataFrame({"index": range(8), "my_score": [0.5, 3, 1, 2, np.nan, 4, 0, 1]}).to_parquet(folder / "s.parquet")
    return folder


def _args(model, folder, out, *extra, subsets=4, seeds=1):
    """4 LDS retrains and the outcome of my_score (random, length, my_score, my_score over 2 length
    buckets) over 1 seed: 8 retrains of 1 or 2 steps each."""
    return ["validate", "--model", str(model), "--data", str(folder / "train.jsonl"), "--target",
            str(folder / "task.jsonl"), "--out", str(out), "--subsets", str(subsets), "--batch-size", "2",
            "--learning-rate", "1e-3", "--outcome", f"{folder / 's.parquet'}:my_score", "--seeds", str(seeds),
            "--length-buckets", "2", "--quiet", *extra]


def _values(path):
    return pq.read_table(path).drop(TIMING)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, inputs):
    """The uninterrupted single-process run the others must reproduce, analysed with a report."""
    folder = tmp_path_factory.mktemp("reference")
    out = folder / "v.parquet"
    assert main(_args(tiny_model_dir, inputs, out, "--scores", f"{inputs / 's.parquet'}:my_score",
                      "--report", str(folder / "report"))) == 0
    return out


def test_one_run_writes_a_row_per_retrain_and_its_analysis(reference, inputs, tmp_path, capsys):
    table = pd.read_parquet(reference)
    assert table["index"].tolist() == list(range(8))
    assert table["kind"].tolist() == ["lds"] * 4 + ["outcome"] * 4
    assert table["subset"].tolist()[:4] == [0, 1, 2, 3]
    assert table["selection"].tolist()[4:] == ["random", "length", "s:my_score", "s:my_score"]
    assert table["buckets"].tolist()[4:] == [0, 0, 0, 2]
    assert all(len(m) == 4 for m in table["members"][:4]) and all(len(m) == 2 for m in table["members"][4:])
    assert sorted(table["members"][6]) == [1, 5]  # my_score's top quarter: 4 and 3
    assert all(len(v) == 3 and np.isfinite(v).all() for v in table["target_loss"])
    assert table["train_loss"].notna().all() and (table["steps"] >= 1).all()
    report = reference.parent / "report"
    assert {"report.md", "lds.png", "predicted_vs_measured.png", "outcome.png", "lds.csv", "outcome.csv"} <= \
        {p.name for p in report.iterdir()}
    assert "NaN where there is no interval: a selection retrained with one seed" in (report / "report.md").read_text()
    lds_table = pd.read_csv(report / "lds.csv")
    assert lds_table["score"].tolist() == ["length (response tokens)", "s:my_score"]
    assert lds_table["missing"].tolist() == [0, 1] and {"beyond_length", "beyond_low", "beyond_high"} <= {*lds_table}
    assert main(["validate", "--runs", str(reference), "--scores", f"{inputs / 's.parquet'}:my_score"]) == 0
    printed = capsys.readouterr().out
    assert "s:my_score: " in printed and "1 values missing, counted as 0" in printed and "gain" in printed
    assert "nan" not in printed and "(no interval: 1 seed; --seeds 2 or more give one)" in printed
    attribution = tmp_path / "a.parquet"  # 3 values a row, one a NaN; the last row unscored
    rows = [[i, -i, np.nan] for i in range(7)] + [None]
    pd.DataFrame({"index": range(8), "attribution": rows}).to_parquet(attribution)
    assert main(["validate", "--runs", str(reference), "--scores", str(attribution)]) == 0
    assert "  a: " in (printed := capsys.readouterr().out) and "(attribution, 2 targets; 10 values missing" in printed


def test_a_killed_run_resumed_equals_one_run(tmp_path, tiny_model_dir, inputs, reference, monkeypatch):
    from gradspec.validation import retrain

    calls = {"n": 0}
    real = retrain.Retrainer.__call__

    def dies_at_the_fourth(self, members, seed, *objective):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(self, members, seed, *objective)

    out = tmp_path / "v.parquet"
    monkeypatch.setattr(retrain.Retrainer, "__call__", dies_at_the_fourth)
    assert main(_args(tiny_model_dir, inputs, out)) == 130
    assert not out.exists() and len(list((tmp_path / "v.parquet.parts").glob("*.parquet"))) == 3
    monkeypatch.setattr(retrain.Retrainer, "__call__", real)
    assert main(_args(tiny_model_dir, inputs, out)) == 2  # an unfinished run needs --resume
    assert main(_args(tiny_model_dir, inputs, out, "--resume")) == 0
    assert _values(out).equals(_values(reference))
    assert main(_args(tiny_model_dir, inputs, out, "--resume")) == 0  # complete: nothing to do


def test_two_shards_then_a_resume_that_merges_equal_one_run(tmp_path, tiny_model_dir, inputs, reference, capsys):
    out = tmp_path / "v.parquet"
    for shard in ("0/2", "1/2"):
        assert main(_args(tiny_model_dir, inputs, out, "--shard", shard)) == 0
    assert not out.exists() and "with --resume (and no --shard) merges them" in capsys.readouterr().out
    assert main(_args(tiny_model_dir, inputs, out, "--resume")) == 0
    assert _values(out).equals(_values(reference))


def test_two_torchrun_ranks_equal_one_run(tmp_path, tiny_model_dir, inputs, reference):
    out = tmp_path / "v.parquet"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "gradspec", *_args(tiny_model_dir, inputs, out)]
    done = subprocess.run(command, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _values(out).equals(_values(reference))


# --- bad input ----------------------------------------------------------------------------------------------------


def test_bad_scores_are_named_by_file_and_field(tmp_path, reference, inputs, capsys):
    scores = inputs / "s.parquet"
    assert main(["validate", "--runs", str(reference), "--scores", f"{scores}:nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{scores}: no column 'nope' (nor a metric of its modules); its columns: " \
        "index, my_score" in err
    short = tmp_path / "a.parquet"
    pd.DataFrame({"index": range(8), "attribution": [[0.1, 0.2]] * 8}).to_parquet(short)
    assert main(["validate", "--runs", str(reference), "--scores", str(short)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{short}: attribution of index 0 has 2 values, but the retrains measured 3 " \
        "target examples" in err
    assert main(["validate", "--runs", str(reference), "--scores", str(scores)]) == 2
    assert f"{scores}: no attribution column" in capsys.readouterr().err
    assert main(["validate", "--runs", str(scores)]) == 2
    assert f"{scores}: not a retrain file of gradspec validate (no kind column)" in capsys.readouterr().err
    assert main(["validate", "--runs", str(reference), "--subsets", "3"]) == 2
    assert "--subsets has no effect with --runs" in capsys.readouterr().err


def test_a_score_file_of_other_data_is_refused_by_analysis_and_outcome(tmp_path, reference, inputs, tiny_model_dir,
                                                                        capsys):
    """A score numbers rows of the data it scored: one of another input (16 rows of another file, the pool 8 rows
    of train.jsonl) was taken, its missing rows counted as 0; now it is refused, naming both, whatever its size.
    One of the pool's own data (the same bytes, wherever they lie) is read."""
    from gradspec.runs.score_files import write_parquet

    table = pd.DataFrame({"index": range(8), "my_score": [0.5, 3, 1, 2, 0.1, 4, 0, 1]})
    other, copy = tmp_path / "other.jsonl", tmp_path / "copy.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 2))
    copy.write_bytes((inputs / "train.jsonl").read_bytes())
    for data, name in ((other, "of_other.parquet"), (copy, "of_copy.parquet")):
        write_parquet(table, tmp_path / name, {"data": str(data.resolve()), "data_bytes": data.stat().st_size})
    want = f"{tmp_path / 'of_other.parquet'}: scored {other.resolve()} ({other.stat().st_size} bytes), but the " \
        f"retrains drew their pool from {(inputs / 'train.jsonl').resolve()} " \
        f"({(inputs / 'train.jsonl').stat().st_size} bytes): its index numbers other rows; pass a score file of " \
        "the pool's data"
    assert main(["validate", "--runs", str(reference), "--scores", f"{tmp_path / 'of_other.parquet'}:my_score"]) == 2
    assert capsys.readouterr().err == f"gradspec: error: {want}\n"
    assert main(_args(tiny_model_dir, inputs, tmp_path / "v.parquet", "--outcome",
                      f"{tmp_path / 'of_other.parquet'}:my_score")) == 2  # before any retrain
    assert capsys.readouterr().err == f"gradspec: error: {want}\n" and not (tmp_path / "v.parquet").exists()
    assert main(["validate", "--runs", str(reference), "--scores", f"{tmp_path / 'of_copy.parquet'}:my_score"]) == 0


def test_a_score_made_at_another_cut_is_said(tmp_path, reference, inputs, caplog):
    """score and align cut rows at 2,048 tokens while train and validate cut them at 512: a score and its
    retrains read a long row differently with nobody told. One default now, and a score file made with another
    --max-length or --template than the retrains' is named, with both values (taken, not refused)."""
    from gradspec.choices import MAX_LENGTH
    from gradspec.runs.config import ScoreConfig
    from gradspec.runs.score_files import write_parquet
    from gradspec.training.train import TrainConfig
    from gradspec.validation.config import ValidateConfig

    assert ScoreConfig().max_length == TrainConfig().max_length == ValidateConfig().max_length == MAX_LENGTH
    data = inputs / "train.jsonl"
    table = pd.DataFrame({"index": range(8), "my_score": [0.5, 3, 1, 2, 0.1, 4, 0, 1]})
    same = {"data": str(data.resolve()), "data_bytes": data.stat().st_size, "max_length": MAX_LENGTH,
            "template": "plain"}
    for name, meta in (("same.parquet", same), ("cut.parquet", {**same, "max_length": 100, "template": "chat"})):
        write_parquet(table, tmp_path / name, meta)
    with caplog.at_level("WARNING", logger="gradspec"):
        assert main(["validate", "--runs", str(reference), "--scores", f"{tmp_path / 'same.parquet'}:my_score"]) == 0
        assert "read otherwise" not in caplog.text
        assert main(["validate", "--runs", str(reference), "--scores", f"{tmp_path / 'cut.parquet'}:my_score"]) == 0
    assert f"{tmp_path / 'cut.parquet'}: scored with --max-length 100 there, {MAX_LENGTH} in the retrains, " \
        "--template chat there, plain in the retrains: its rows were read otherwise" in caplog.text


def test_options_are_checked_before_the_model_loads(tmp_path, inputs, reference, capsys, monkeypatch):
    from gradspec.validation import run

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(run, "load_model", load_model)
    base = ["validate", "--data", str(inputs / "train.jsonl"), "--out", str(tmp_path / "v.parquet")]
    assert main(base) == 2
    assert "--target is required" in capsys.readouterr().err
    assert main([*base, "--target", str(inputs / "task.jsonl"), "--fraction", "1"]) == 2
    assert "--fraction must be between 0 and 1 (not either), got 1.0" in capsys.readouterr().err
    assert main([*base, "--target", str(inputs / "task.jsonl"), "--metric", "nowhere_at_all:f"]) == 2
    assert "--metric nowhere_at_all:f: cannot be imported" in capsys.readouterr().err
    assert main([*base[:-2], "--target", str(inputs / "task.jsonl"), "--out", str(reference)]) == 2
    assert f"{reference} exists; pass --overwrite or choose another --out" in capsys.readouterr().err
    assert main([*base, "--target", str(inputs / "task.jsonl"), "--subsets", "0"]) == 2
    assert "--subsets, --outcome, --removal and --objectives: nothing to retrain" in capsys.readouterr().err
    assert main([*base, "--target", str(inputs / "task.jsonl"), "--outcome", f"{inputs / 's.parquet'}:nope"]) == 2
    assert f"{inputs / 's.parquet'}: no column 'nope'" in capsys.readouterr().err


def test_lora_retrains_train_adapters_and_leave_the_model_as_found(tokenizer, monkeypatch, tmp_path, inputs, capsys):
    from conftest import tiny_model

    model = tiny_model("llama")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rows = {i: tokenize(_conversation(r["instruction"], r["output"]), tokenizer) for i, r in enumerate(ROWS)}
    items = [Item(Sample(0, _conversation("Q", "It is 2, of course.")), rows[1])]
    retrain = Retrainer(model, tokenizer, rows, items, Recipe(batch_size=2, learning_rate=1e-2, lora_rank=4))
    before = retrain.target_losses()
    once, again = retrain([0, 1, 2, 3], seed=0), retrain([0, 1, 2, 3], seed=0)
    assert once.target_loss == again.target_loss and once.target_loss[0] < before[0] and once.steps == 2
    assert type(model).__name__ == "LlamaForCausalLM" and model.state_dict().keys() == start.keys()
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "peft" else object())
    assert main(["validate", "--data", str(inputs / "train.jsonl"), "--target", str(inputs / "task.jsonl"),
                 "--out", str(tmp_path / "v.parquet"), "--lora-rank", "4"]) == 2
    assert "--lora-rank trains LoRA adapters with peft, which is not installed: pip install peft" in \
        capsys.readouterr().err


def test_the_outcome_reports_a_metric_s_gain_over_random(tmp_path, tiny_model_dir, inputs, monkeypatch, capsys):
    """--metric module:function runs after each retrain; the outcome reports its gain over random's, seed by seed."""
    (tmp_path / "my_metric.py").write_text("def weight_sum(model, tokenizer):\n"
                                           "    return float(sum(p.double().sum() for p in model.parameters()))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "o.parquet"
    args = _args(tiny_model_dir, inputs, out, "--metric", "my_metric:weight_sum", "--report", str(tmp_path / "r"),
                 subsets=0, seeds=2)
    assert main(args) == 0
    table = pd.read_parquet(out)
    assert len(table) == 2 * 4 and table["metric"].notna().all() and table["seed"].tolist() == [0] * 4 + [1] * 4
    outcome = pd.read_csv(tmp_path / "r" / "outcome.csv").set_index(["selection", "buckets"])
    mine, random = table.iloc[[2, 6]]["metric"].to_numpy(), table.iloc[[0, 4]]["metric"].to_numpy()
    assert outcome.loc[("s:my_score", 0), "metric_gain"] == pytest.approx((mine - random).mean())
    assert outcome.loc[("s:my_score", 0), "seeds"] == 2 and "gain" in capsys.readouterr().out


def test_an_align_attribution_file_is_a_score_validate_reads(reference, inputs, tiny_model_dir, tmp_path, capsys):
    """align --attribution (K-FAC preconditioned) on the same pool and target, then validate --scores on it."""
    out = tmp_path / "kfac.parquet"
    assert main(["align", "--model", str(tiny_model_dir), "--data", str(inputs / "train.jsonl"), "--target",
                 str(inputs / "task.jsonl"), "--out", str(out), "--attribution", "--precondition", "kfac",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["validate", "--runs", str(reference), "--scores", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "  kfac: " in printed and "(attribution, 3 targets" in printed and "missing" not in printed
