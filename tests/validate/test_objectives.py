"""validate --objectives: the whole pool retrained with plain next-token training (NTP) and with each of
gradspec train's other losses (WIT, SFTMix). The losses against the training modules' own and a slow
reference, SFTMix's paired batches, the plan's order, the table on a planted retrain file, a run end to
end (its NTP retrains are the default retrains, WIT at (0, 1) trains as NTP), and bad names refused."""

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from gradspec.cli import main
from gradspec.data.batching import pad_batch, pad_id_of
from gradspec.data.templates import IGNORE_INDEX, tokenize
from gradspec.engine.loss import item_losses, response_losses
from gradspec.options import OptionError
from gradspec.training import sftmix
from gradspec.validation.config import ValidateConfig
from gradspec.validation.objective_losses import WIT, SFTMix
from gradspec.validation.report import analyse, summary, write_report
from gradspec.validation.retrain import Recipe, Retrainer
from gradspec.validation.run import Pool, job_count, plan

pytestmark = pytest.mark.usefixtures("single_thread")


ROWS = [{"instruction": f"Question {i}: what is {i} plus one?",
         "output": f"It is {i + 1}, of course." + " Yes." * (i % 3)} for i in range(8)]


def _conversation(row):
    return [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": row["output"]}]


def _batch(tokenizer, rows):
    return pad_batch([tokenize(_conversation(r), tokenizer) for r in rows], pad_id_of(tokenizer), "cpu")


# --- the losses ---------------------------------------------------------------------------------------------------


def _wit_by_positions(logits, ids, mask, labels, lp, lr):
    """WIT sample by sample, position by position: each target token's weight (lp for a prompt token, lr for
    a response token, none for padding), the weighted sum of their cross-entropies over the count of those
    with weight; then the mean over samples. The slow reference."""
    losses = []
    for k in range(len(ids)):
        total, count = 0.0, 0
        logp = torch.log_softmax(logits[k].double(), -1)
        for t in range(ids.shape[1] - 1):
            if not mask[k, t + 1]:
                continue
            weight = lr if labels[k, t + 1] != IGNORE_INDEX else lp
            if weight:
                total, count = total - weight * float(logp[t, ids[k, t + 1]]), count + 1
        losses.append(total / count)
    return float(np.mean(losses))


def test_wit_at_0_1_is_the_ntp_retrains_loss_and_each_sample_weighs_its_own_tokens(tokenizer):
    """Responses of 9 to 15 tokens: WIT (0, 1) gives the NTP retrains' loss (each sample's mean, then the
    batch's), not a token mean over the batch; (0.3, 1) equals the slow reference."""
    from conftest import tiny_model

    model = tiny_model("llama")
    ids, mask, labels = _batch(tokenizer, ROWS[:3])
    assert len({int(n) for n in (labels[:, 1:] != IGNORE_INDEX).sum(1)}) == 3  # three response lengths
    ntp = response_losses(model, ids, mask, labels)[0].mean().item()
    assert WIT(0.0, 1.0).loss(model, ids, mask, labels).item() == pytest.approx(ntp, rel=1e-6)
    logits = model(input_ids=ids, attention_mask=mask).logits.detach()
    token_mean = sftmix.ntp_loss(logits, labels, torch.nn.Identity()).item()  # train's NTP: over the batch's tokens
    assert abs(token_mean - ntp) > 1e-4  # so the first check tells the two apart
    wit = WIT(0.3, 1.0).loss(model, ids, mask, labels)
    assert wit.item() == pytest.approx(_wit_by_positions(logits, ids, mask, labels, 0.3, 1.0), rel=1e-6)
    wit.backward()  # a loss to train with
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="both 0"):
        WIT(0.0, 0.0)


def _response_labels(ids, starts):
    labels = ids.clone()
    for row, start in enumerate(starts):
        labels[row, :start] = IGNORE_INDEX
    return labels


def test_sftmix_loss_is_the_training_module_s_for_the_same_inputs_and_lambda():
    """With equal response lengths, NTP + mu * Mixup as SFTMixTrainer.compute_loss forms it (sftmix.ntp_loss,
    sftmix.mixup_loss on the last hidden states); with unequal ones, its NTP term is the NTP retrains' (each
    sample's mean) and its Mixup term the module's."""
    from conftest import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 500, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    lam = torch.tensor([0.3, 0.9])
    objective = SFTMix(pd.DataFrame({"index": [], "mean_perplexity": []}))
    assert (objective.alpha, objective.mu) == (sftmix.ALPHA, sftmix.MU)
    for starts in ([5, 5, 5, 5], [2, 8, 5, 10]):
        labels = _response_labels(ids, starts)
        got = objective.ntp_and_mixup(model, ids, mask, labels, lam)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden, head = out.hidden_states[-1], model.get_output_embeddings()
        mixup = sftmix.mixup_loss(hidden, labels, head, lam)
        if starts[0] == starts[1]:
            want = sftmix.ntp_loss(hidden, labels, head) + sftmix.MU * mixup
        else:
            want = response_losses(model, ids, mask, labels)[0].mean() + sftmix.MU * mixup
            assert sftmix.ntp_loss(hidden, labels, head).item() != pytest.approx((want - sftmix.MU * mixup).item(),
                                                                                rel=1e-4)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.manual_seed(3)
    drawn = objective.lam(2)
    torch.manual_seed(3)
    assert torch.equal(objective.lam(2), drawn) and ((drawn > 0) & (drawn < 1)).all()


def test_sftmix_batches_pair_confident_with_unconfident_rows_for_ntp_s_steps():
    """The halves by perplexity among the members (7: the middle row unconfident), 2 confident then 2
    unconfident rows a step, every member in each epoch, as many steps as an NTP retrain, seeded."""
    perplexity = pd.DataFrame({"index": range(10), "mean_perplexity": [5, 1, 9, 3, 7, 2, 8, 4, 6, 0]})
    members = [0, 1, 2, 3, 4, 5, 6]  # perplexity 5 1 9 3 7 2 8: confident 1, 5, 3 (1, 2, 3), the rest not
    objective, recipe = SFTMix(perplexity), Recipe(batch_size=4, epochs=2)
    steps = objective.batches(members, recipe, seed=0)
    assert len(steps) == recipe.steps(len(members)) == 4
    for batch in steps:
        assert len(batch) == 4 and set(batch[:2]) <= {1, 3, 5} and set(batch[2:]) <= {0, 2, 4, 6}
    assert set(steps[0] + steps[1]) == set(members) == set(steps[2] + steps[3])
    assert objective.batches(members, recipe, seed=0) == steps != objective.batches(members, recipe, seed=1)
    assert objective.batches(members, Recipe(batch_size=2, max_steps=9), seed=0)[8][0] in {1, 3, 5}


def test_sftmix_confidence_is_the_start_model_s_response_perplexity(tokenizer):
    from conftest import tiny_model

    from gradspec.data.batching import Item
    from gradspec.data.readers import Sample

    model = tiny_model("llama")
    rows = {i: tokenize(_conversation(r), tokenizer) for i, r in enumerate(ROWS)}
    objective = SFTMix.at_start(model, tokenizer, rows)
    losses = {item.sample.index: loss for item, loss, _ in
              item_losses(model, tokenizer, [Item(Sample(i, []), t) for i, t in rows.items()])}
    got = objective.perplexity.set_index("index")["mean_perplexity"]
    assert got.to_dict() == pytest.approx({i: np.exp(loss) for i, loss in losses.items()}, rel=1e-9)
    assert sorted(got.index) == list(range(8))


# --- the plan and the table ---------------------------------------------------------------------------------------


def test_the_plan_puts_each_seed_s_ntp_then_its_objectives_after_every_other_kind():
    config = ValidateConfig(target="t.jsonl", subsets=2, outcome=("s.parquet:a",), seeds=2, length_buckets=0,
                            objectives=["sftmix", "wit", "wit"], seed=7)
    assert config.objectives == ("wit", "sftmix")  # each once, in one order: the same retrains
    tokens = {i: SimpleNamespace(num_tokens=10 + i, num_response_tokens=i + 1) for i in range(1, 11)}
    pool = Pool(12, tokens, [])
    jobs = plan(config, pool, {"s:a": np.arange(12.0)})
    assert len(jobs) == job_count(config) == 2 + 2 * 3 + 2 * 3
    assert [j.kind for j in jobs] == ["lds"] * 2 + ["outcome"] * 6 + ["objective"] * 6
    trained = jobs[8:]
    assert [j.selection for j in trained] == ["ntp", "wit", "sftmix"] * 2
    assert [j.seed for j in trained] == [7] * 3 + [8] * 3
    assert all(j.members == list(range(1, 11)) and j.fraction == 1.0 and j.subset is None for j in trained)
    without = ValidateConfig(target="t.jsonl", subsets=2, outcome=("s.parquet:a",), seeds=2, length_buckets=0, seed=7)
    assert plan(without, pool, {"s:a": np.arange(12.0)}) == jobs[:8] and job_count(without) == 8


def _retrain_file(path, rows, targets=2):
    import pyarrow as pa

    from gradspec.runs.score_files import write_parquet

    meta = {"rows": 10, "targets": targets, "target": "task.jsonl", "pool": 10, "prompt_weight": 0.3,
            "response_weight": 1.0}
    write_parquet(pa.Table.from_pylist([{"index": k, **r} for k, r in enumerate(rows)]), path, meta)
    return path


def _row(kind, selection, seed, loss, metric=None, subset=None):
    return {"kind": kind, "subset": subset, "selection": selection, "buckets": 0, "seed": seed,
            "members": list(range(10)) if kind != "lds" else [0, 1, 2, 3, 4], "target_loss": [loss - 0.1, loss + 0.1],
            "metric": metric}


def test_the_table_of_a_planted_retrain_file(tmp_path):
    """Over 4 seeds, wit's loss 0.05 below NTP's of the same seed (NTP's own varying by seed much more), its
    metric 1 above; sftmix's loss beside NTP's by small offsets of both signs. wit's gain is 0.05, its interval
    above 0; sftmix's interval covers 0. A file of LDS retrains alone (an older run) still analyses."""
    base, noise = [2.0, 2.6, 1.7, 2.3], [0.02, -0.03, 0.01, -0.005]
    rows = [_row("lds", None, 0, 2.0 + k / 10, subset=k) for k in range(3)]
    for s in range(4):
        rows += [_row("objective", "ntp", 10 + s, base[s], metric=float(s)),
                 _row("objective", "wit", 10 + s, base[s] - 0.05, metric=s + 1.0),
                 _row("objective", "sftmix", 10 + s, base[s] + noise[s], metric=float(s))]
    analysis = analyse([str(_retrain_file(tmp_path / "r.parquet", rows))], [])
    table = analysis.objectives.set_index("objective")
    assert table.index.tolist() == ["ntp", "wit", "sftmix"] and (table["seeds"] == 4).all()
    assert table.loc["wit", "gain"] == pytest.approx(0.05) and table.loc["wit", "gain_low"] > 0.04
    assert table.loc["wit", "loss"] == pytest.approx(np.mean(base) - 0.05)
    assert table.loc["wit", "metric_gain"] == pytest.approx(1.0) and table.loc["sftmix", "metric_gain"] == 0
    assert table.loc["sftmix", "gain_low"] < 0 < table.loc["sftmix", "gain_high"]
    assert table.loc["sftmix", "gain"] == pytest.approx(-np.mean(noise))
    text = summary(analysis)
    assert "Objectives, each on the whole pool" in text and "  wit: loss" in text and "gain +0.0500 [+0.0" in text
    assert "  ntp: loss" in text and "metric gain +1.0000" in text
    report = write_report(analysis, tmp_path / "report")
    assert "## Objectives" in report.read_text() and "prompt weight 0.3" in report.read_text()
    assert pd.read_csv(tmp_path / "report" / "objectives.csv")["objective"].tolist() == ["ntp", "wit", "sftmix"]

    older = analyse([str(_retrain_file(tmp_path / "old.parquet", rows[:3]))], [])
    assert older.objectives.empty and "Objectives" not in summary(older)
    write_report(older, tmp_path / "old")
    assert not (tmp_path / "old" / "objectives.csv").exists()
    rows[3]["seed"] = None
    with pytest.raises(Exception, match="row 3 has no seed"):
        analyse([str(_retrain_file(tmp_path / "bad.parquet", rows))], [])


# --- a run --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("objectives")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    return folder


def _args(model, folder, out, *extra):
    return ["validate", "--model", str(model), "--data", str(folder / "train.jsonl"), "--target",
            str(folder / "task.jsonl"), "--out", str(out), "--subsets", "0", "--batch-size", "2",
            "--learning-rate", "1e-3", "--quiet", *extra]


def test_an_objectives_run_end_to_end(tmp_path, tiny_model_dir, inputs, capsys):
    """--subsets 0 --objectives sftmix wit --seeds 2: per seed ntp, wit, sftmix on the whole pool, the same
    steps; each NTP retrain is the default retrain of the pool with its seed, to the bit; a second run with
    --objectives wit --prompt-weight 0 repeats those NTP retrains and trains WIT (0, 1) as NTP."""
    import pyarrow.parquet as pq

    from gradspec.data.models import fit_to_context, load_model
    from gradspec.validation.run import read_pool, read_rows

    out = tmp_path / "o.parquet"
    assert main(_args(tiny_model_dir, inputs, out, "--objectives", "sftmix", "wit", "--seeds", "2", "--report",
                      str(tmp_path / "report"))) == 0
    table = pd.read_parquet(out)
    assert table["kind"].tolist() == ["objective"] * 6
    assert table["selection"].tolist() == ["ntp", "wit", "sftmix"] * 2 and table["seed"].tolist() == [0] * 3 + [1] * 3
    assert all(list(m) == list(range(8)) for m in table["members"]) and (table["steps"] == 4).all()
    assert all(np.isfinite(v).all() and len(v) == 3 for v in table["target_loss"])
    meta = json.loads(pq.read_schema(out).metadata[b"gradspec"])
    assert meta["objectives"] == ["wit", "sftmix"] and (meta["prompt_weight"], meta["response_weight"]) == (0.3, 1.0)
    printed = capsys.readouterr().out
    assert "  sftmix: loss " in printed and "over 2 seeds" in printed
    assert "## Objectives" in (tmp_path / "report" / "report.md").read_text()

    config = ValidateConfig(model=str(tiny_model_dir), data=str(inputs / "train.jsonl"),
                            target=str(inputs / "task.jsonl"), batch_size=2, learning_rate=1e-3)
    model, tokenizer = load_model(str(tiny_model_dir), "cpu")
    pool = read_pool(config, *read_rows(config), tokenizer, fit_to_context(config.max_length, model))
    retrain = Retrainer(model, tokenizer, pool.tokens, pool.targets, Recipe(batch_size=2, learning_rate=1e-3))
    for k, seed in ((0, 0), (3, 1)):
        assert retrain(pool.indices, seed).target_loss == list(table["target_loss"][k])

    plain = tmp_path / "plain.parquet"
    assert main(_args(tiny_model_dir, inputs, plain, "--objectives", "wit", "--prompt-weight", "0")) == 0
    again = pd.read_parquet(plain)
    assert again["selection"].tolist() == ["ntp", "wit"] * 3  # --seeds' default, 3
    assert list(again["target_loss"][0]) == list(table["target_loss"][0])
    assert list(again["target_loss"][1]) == pytest.approx(list(again["target_loss"][0]), rel=1e-5)
    assert list(again["target_loss"][1]) != list(table["target_loss"][1])  # lp = 0.3 trains otherwise


def test_bad_objectives_are_named_before_the_model_loads(tmp_path, inputs, monkeypatch, capsys):
    from gradspec.validation import run

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(run, "load_model", load_model)
    base = _args("nowhere", inputs, tmp_path / "v.parquet")
    cases = [(["--objectives", "mixup"], "--objectives 'mixup': not an objective; choose from wit, sftmix"),
             (["--objectives", "wti"], "(did you mean wit?)"),
             (["--objectives", "ntp"], "plain next-token training, the baseline, is always retrained"),
             (["--objectives", "sftmix", "--batch-size", "3"], "--batch-size 3: SFTMix pairs a confident with an "
                                                               "unconfident sample in each batch; give an even"),
             (["--objectives", "wit", "--prompt-weight", "0", "--response-weight", "0"],
              "--prompt-weight and --response-weight are both 0"),
             (["--objectives", "sftmix", "--prompt-weight", "0.5"], "--prompt-weight has no effect without "
                                                                    "--objectives wit"),
             (["--objectives", "wit", "--response-weight", "-1"], "--response-weight must be at least 0")]
    for extra, want in cases:
        assert main([*base, *extra]) == 2, extra
        assert want in capsys.readouterr().err, extra
    assert main(["validate", "--runs", str(tmp_path / "x.parquet"), "--objectives", "wit"]) == 2
    assert "--objectives has no effect with --runs" in capsys.readouterr().err
    assert ValidateConfig(objectives="sftmix").objectives == ("sftmix",) and ValidateConfig().objectives == ()
    with pytest.raises(OptionError, match="objectives 'nope': not an objective"):
        ValidateConfig(objectives=["wit", "nope"])
