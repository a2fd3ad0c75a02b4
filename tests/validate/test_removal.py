"""validate's removal test (issue 53, item 2): the plan (after the LDS subsets and the outcome, each seed's
random removal and each score's top and bottom removed), the effects against random removal on a planted
retrain file and by hand, one tiny run end to end, retrain files from before the test, and bad options."""

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats

from gradspec.cli import main
from gradspec.runs.run_folder.parts import rows_table
from gradspec.runs.score_files import write_parquet
from gradspec.validation.config import ValidateConfig
from gradspec.validation.outcome import top_rows
from gradspec.validation.removal import ends
from gradspec.validation.removal import plan as removal_plan
from gradspec.validation.report import analyse, write_report
from gradspec.validation.run import Pool, job_count, plan
from gradspec.validation.subsets import subset_size

# --- the plan -----------------------------------------------------------------------------------------------------


def _pool(indices: list[int], rows: int) -> Pool:
    tokens = {i: SimpleNamespace(num_tokens=10 + i % 7, num_response_tokens=3 + i % 5) for i in indices}
    return Pool(rows, tokens, [])


def _config(**kw) -> ValidateConfig:
    return ValidateConfig(target="task.jsonl", subsets=3, outcome=("s.parquet:x",), top=0.2, seeds=3, length_buckets=2,
                          **kw)


def test_the_plan_puts_each_seed_s_removals_after_the_lds_subsets_and_the_outcome():
    rng = np.random.default_rng(0)
    rows = 45
    indices = [i for i in range(rows) if i % 9 != 4]  # 40 rows with response tokens, 5 without
    pool = _pool(indices, rows)
    outcome = {"s:x": rng.normal(size=rows)}
    a, b = rng.normal(size=rows), rng.permutation(rows).astype(float)
    a[[indices[3], indices[17]]] = np.nan  # no value: removed last from either end
    config = _config(removal=("a.parquet", "b.parquet:y"), remove=0.2, seed=5)
    jobs = plan(config, pool, outcome, {"a": a, "b:y": b})
    before = plan(_config(seed=5), pool, outcome)  # the same config without the removal test
    assert len(jobs) == job_count(config) == len(before) + 3 * (1 + 2 * 2) == 3 + 3 * 4 + 15
    assert jobs[:len(before)] == before  # the LDS and outcome retrains keep their chunk numbers
    removal = jobs[len(before):]
    assert {j.kind for j in removal} == {"removal"} and {j.removed for j in before} == {None}
    assert [(j.selection, j.removed) for j in removal[:5]] == [("random", "random"), ("a", "top"), ("a", "bottom"),
                                                              ("b:y", "top"), ("b:y", "bottom")]
    assert [j.seed for j in removal] == [5] * 5 + [6] * 5 + [7] * 5
    count = subset_size(40, 0.2)
    assert count == 8
    for job in removal:
        gone = sorted(set(indices) - set(job.members))
        assert len(gone) == count and job.members == sorted(set(indices) - set(gone))  # kept: pool less removed
        assert job.fraction == pytest.approx(32 / 40) and job.subset is None and job.buckets == 0
    by = {(j.selection, j.removed, j.seed): sorted(set(indices) - set(j.members)) for j in removal}
    ranked_a = sorted((i for i in indices if np.isfinite(a[i])), key=lambda i: -a[i])  # a slow reference
    assert by[("a", "top", 5)] == sorted(ranked_a[:count]) and by[("a", "bottom", 5)] == sorted(ranked_a[-count:])
    assert by[("b:y", "top", 5)] == top_rows(b, indices, {i: 1 for i in indices}, count, 0)  # as the outcome's top
    assert by[("b:y", "top", 6)] == by[("b:y", "top", 5)]  # a score's ends are the same in every seed
    for name in ("a", "b:y"):
        assert not set(by[(name, "top", 5)]) & set(by[(name, "bottom", 5)])
    randoms = [by[("random", "random", s)] for s in (5, 6, 7)]
    assert len({tuple(r) for r in randoms}) == 3  # drawn per seed
    assert plan(config, pool, outcome, {"a": a, "b:y": b}) == jobs  # and again the same
    outcome_random = [j.members for j in before if j.selection == "random"]  # as many rows: --top 0.2
    assert all(r != m for r, m in zip(randoms, outcome_random, strict=True))  # a generator stream of its own


def test_ends_take_rows_without_a_value_last_and_stay_disjoint_under_ties(caplog):
    values = np.array([3.0, np.nan, 1.0, 1.0, 1.0, 1.0, -2.0, np.nan])
    assert ends(values, [0, 1, 2, 3, 4, 5, 6, 7], 2) == ([0, 2], [5, 6])
    assert ends(np.ones(6), list(range(6)), 3) == ([0, 1, 2], [3, 4, 5])  # a constant score: still disjoint
    assert ends(values, [0, 1, 6, 7], 3) == ([0, 1, 6], [0, 1, 6])  # more than the rows with a value: NaN too
    with caplog.at_level("WARNING", logger="gradspec"):
        removal_plan({"v": values}, list(range(8)), 0.25, 1, 0)
        assert "share" not in caplog.text
        removal_plan({"v": values}, list(range(8)), 0.5, 1, 0)
    assert "v: its top and bottom 4 rows share 2 (fewer than twice as many rows of the pool have a value)" in \
        caplog.text


# --- the analysis -------------------------------------------------------------------------------------------------

META = {"rows": 60, "targets": 3, "target": "task.jsonl", "pool": 60, "model": "m", "data": "d"}


def _retrains(path, rows: list[dict], meta: dict = META) -> str:
    """A retrain file as validate writes it (the columns analyse reads), from rows of kind, selection, removed
    (no such column where no row has the key), seed, members, target_loss (metric optional)."""
    table = rows_table([{"index": k, "subset": None, "buckets": 0, "fraction": 0.9, "metric": None, **r}
                        for k, r in enumerate(rows)])  # as validate's parts are made
    write_parquet(table, path, meta)
    return str(path)


def test_effects_by_hand_are_signed_so_that_positive_means_the_score_is_right(tmp_path):
    """Top: loss without the top - loss without random rows; bottom: loss without random - loss without the
    bottom; paired by seed, with scipy's t interval over seeds. The metric (higher is better) signed alike."""
    losses = {("random", "random"): [1.0, 2.0, 1.5], ("s", "top"): [1.5, 2.1, 1.8], ("s", "bottom"): [0.8, 1.9, 1.6]}
    rows = [{"kind": "removal", "selection": name, "removed": end, "seed": seed, "members": [0, 1],
             "target_loss": [value - 0.1, value, value + 0.1], "metric": -2 * value}
            for seed in range(3) for (name, end), values in losses.items() for value in [values[seed]]]
    table = analyse([_retrains(tmp_path / "r.parquet", rows)], []).removal.set_index(["score", "removed"])
    top, bottom = np.array([0.5, 0.1, 0.3]), np.array([0.2, 0.1, -0.1])
    for end, effect in (("top", top), ("bottom", bottom)):
        row = table.loc[("s", end)]
        assert row["effect"] == pytest.approx(effect.mean()) and row["seeds"] == 3
        want = stats.t.interval(0.95, 2, loc=effect.mean(), scale=stats.sem(effect))
        assert (row["effect_low"], row["effect_high"]) == pytest.approx(want)
        assert row["metric_effect"] == pytest.approx(2 * effect.mean())
    assert table.loc[("s", "top"), "loss"] == pytest.approx(np.mean(losses[("s", "top")]))
    assert table.loc[("random", "random"), "effect"] == 0


def _planted(tmp_path, seeds: int = 8):
    """60 rows: 10 help the target (removing one raises every target's loss by 0.05), 10 hurt it (lowers it
    by 0.05), 40 do nothing. planted ranks the helpful on top and the harmful at the bottom; blind is random
    on the 40 that do nothing and 0 on the rest, so its ends remove rows that change nothing: its true effect
    is 0 (random removal's expected change is 0, the pool's effects summing to 0)."""
    rng = np.random.default_rng(0)
    helps = np.r_[np.ones(10), -np.ones(10), np.zeros(40)]
    planted = helps + 0.01 * rng.normal(size=60)
    blind = np.r_[np.zeros(20), rng.normal(size=40)]
    base = np.array([2.0, 2.5, 3.0])
    rows = []
    for s in range(seeds):
        removals = [("random", "random", rng.choice(60, 6, replace=False))]
        for name, values in (("scores:planted", planted), ("scores:blind", blind)):
            top, bottom = ends(values, list(range(60)), 6)
            removals += [(name, "top", top), (name, "bottom", bottom)]
        for name, end, gone in removals:
            loss = base + 0.05 * helps[list(gone)].sum() + rng.normal(scale=0.05, size=3)
            rows.append({"kind": "removal", "selection": name, "removed": end, "seed": s,
                         "members": sorted(set(range(60)) - set(int(i) for i in gone)), "target_loss": loss.tolist()})
    return _retrains(tmp_path / "r.parquet", rows)


def test_a_planted_score_s_effects_exclude_0_and_a_blind_score_s_cover_it(tmp_path, capsys):
    retrains = _planted(tmp_path)
    analysis = analyse([retrains], [])
    table = analysis.removal.set_index(["score", "removed"])
    for end in ("top", "bottom"):
        row = table.loc[("scores:planted", end)]
        assert row["effect"] == pytest.approx(0.3, abs=0.1) and row["effect_low"] > 0.1, row
        blind = table.loc[("scores:blind", end)]
        assert blind["effect_low"] < 0 < blind["effect_high"] and abs(blind["effect"]) < 0.1, blind
    assert table.loc[("scores:planted", "top"), "loss"] > table.loc[("random", "random"), "loss"] > \
        table.loc[("scores:planted", "bottom"), "loss"]
    report = write_report(analysis, tmp_path / "report")
    text = report.read_text()
    assert "## Removal test" in text and "![removal](removal.png)" in text and "## LDS" not in text
    assert "signed so that positive = the score is right: for top, the loss without its top rows minus the loss " \
        "without random rows" in text
    assert (tmp_path / "report" / "removal.png").stat().st_size > 0
    assert pd.read_csv(tmp_path / "report" / "removal.csv").columns.tolist() == \
        ["score", "removed", "seeds", "loss", "effect", "effect_low", "effect_high"]
    assert main(["validate", "--runs", retrains]) == 0
    printed = capsys.readouterr().out
    assert "Removal test (" in printed and "  random rows removed: loss " in printed
    assert "  scores:planted, its top removed: loss " in printed and "over 8 seeds" in printed and "nan" not in printed


# --- files from before the removal test, and bad files ------------------------------------------------------------


def test_a_retrain_file_without_the_removed_column_still_analyses(tmp_path):
    """A file validate wrote before the removal test: LDS and outcome rows, no removed column."""
    rng = np.random.default_rng(1)
    rows = [{"kind": "lds", "selection": None, "seed": 0, "members": sorted(rng.choice(60, 30, replace=False)),
             "target_loss": rng.normal(2, 0.1, 3).tolist()} for _ in range(4)]
    rows += [{"kind": "outcome", "selection": name, "seed": 0, "members": [1, 2], "target_loss": [2.0, 2.1, v]}
             for name, v in (("random", 2.2), ("length", 2.3))]
    old = _retrains(tmp_path / "old.parquet", rows)
    assert "removed" not in pq.read_schema(old).names
    scores = tmp_path / "s.parquet"
    pd.DataFrame({"index": range(60), "x": rng.normal(size=60)}).to_parquet(scores)
    analysis = analyse([old], [f"{scores}:x"], resamples=20)
    assert len(analysis.lds) == 1 and analysis.outcome["selection"].tolist() == ["random", "length"]
    assert analysis.removal.empty
    assert "## Removal test" not in write_report(analysis, tmp_path / "report").read_text()
    (tmp_path / "new").mkdir()
    new = _planted(tmp_path / "new", seeds=2)
    both = analyse([old, new], [])  # an old file beside a new one
    assert len(both.removal) == 5 and len(both.outcome) == 2


def test_a_removal_row_without_its_end_is_named(tmp_path, capsys):
    row = {"kind": "removal", "selection": "random", "removed": None, "seed": 0, "members": [1],
           "target_loss": [1.0, 1.0, 1.0]}
    path = _retrains(tmp_path / "r.parquet", [row])
    assert main(["validate", "--runs", path]) == 2
    assert f"{path}: row 0 has no removed; pass validate's --out" in capsys.readouterr().err
    path = _retrains(tmp_path / "r2.parquet", [{**row, "removed": 3}])
    assert main(["validate", "--runs", path]) == 2
    assert f"{path}: its removed column holds int64; pass validate's --out" in capsys.readouterr().err


# --- one tiny run, end to end -------------------------------------------------------------------------------------

ROWS = [{"instruction": f"Question {i}: what is {i} plus one?",
         "output": f"It is {i + 1}, of course." + " Yes." * (i % 3)} for i in range(8)]


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    pd.DataFrame({"index": range(8), "my_score": [0.5, 3, 1, 2, np.nan, 4, 0, 1]}).to_parquet(tmp_path / "s.parquet")
    return tmp_path


def _args(model, folder, *extra):
    return ["validate", "--model", str(model), "--data", str(folder / "train.jsonl"), "--target",
            str(folder / "task.jsonl"), "--out", str(folder / "v.parquet"), "--batch-size", "2",
            "--learning-rate", "1e-3", "--quiet", *extra]


def test_a_removal_run_end_to_end(tiny_model_dir, inputs, capsys):
    """2 seeds of random removal and my_score's top and bottom quarter removed: 6 retrains on 6 of 8 rows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_args(tiny_model_dir, inputs, "--subsets", "0", "--removal", f"{inputs / 's.parquet'}:my_score",
                          "--remove", "0.25", "--seeds", "2", "--report", str(inputs / "report"))) == 0
    finally:
        torch.set_num_threads(threads)
    table = pd.read_parquet(inputs / "v.parquet")
    assert table["index"].tolist() == list(range(6)) and set(table["kind"]) == {"removal"}
    assert table["selection"].tolist() == ["random", "s:my_score", "s:my_score"] * 2
    assert table["removed"].tolist() == ["random", "top", "bottom"] * 2 and table["seed"].tolist() == [0] * 3 + [1] * 3
    gone = [sorted(set(range(8)) - set(m)) for m in table["members"]]
    assert gone[1] == gone[4] == [1, 5] and gone[2] == gone[5] == [0, 6]  # top: 4 and 3; bottom: 0 and 0.5
    assert all(len(g) == 2 for g in gone) and gone[0] != gone[3]
    assert (table["fraction"] == 0.75).all() and all(len(v) == 3 and np.isfinite(v).all() for v in table["target_loss"])
    loss = table["target_loss"].map(np.mean).to_numpy()
    removal = pd.read_csv(inputs / "report" / "removal.csv").set_index(["score", "removed"])
    assert removal.loc[("s:my_score", "top"), "effect"] == pytest.approx(np.mean(loss[[1, 4]] - loss[[0, 3]]))
    assert removal.loc[("s:my_score", "bottom"), "effect"] == pytest.approx(np.mean(loss[[0, 3]] - loss[[2, 5]]))
    text = (inputs / "report" / "report.md").read_text()
    assert "## Removal test" in text and "## Selection outcome" not in text and "| s:my_score | top " in text
    printed = capsys.readouterr().out
    assert "s:my_score, its bottom removed: loss " in printed and "over 2 seeds" in printed


# --- bad options --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "said"), [
    (["--remove", "0"], "--remove must be between 0 and 1 (not either), got 0.0"),
    (["--remove", "1.5"], "--remove must be"),
    (["--remove", "1"], "--remove must be between 0 and 1 (not either), got 1.0"),
])
def test_bad_shares_to_remove_are_named_before_the_model_loads(extra, said, inputs, capsys):
    assert main(_args("nowhere", inputs, "--subsets", "0", "--removal", f"{inputs / 's.parquet'}:my_score",
                      *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_a_missing_removal_score_and_removal_options_with_runs_are_named(inputs, tmp_path, capsys):
    missing = inputs / "none.parquet"
    assert main(_args("nowhere", inputs, "--subsets", "0", "--removal", f"{missing}:x")) == 2
    assert f"--removal {missing}:x: no such score file" in capsys.readouterr().err
    retrains = _retrains(tmp_path / "r.parquet", [{"kind": "removal", "selection": "random", "removed": "random",
                                                   "seed": 0, "members": [1], "target_loss": [1.0, 1.0, 1.0]}])
    assert main(["validate", "--runs", retrains, "--remove", "0.2"]) == 2
    assert "--remove has no effect with --runs" in capsys.readouterr().err


def test_a_run_without_removals_records_no_removal_option_so_older_runs_resume(tmp_path):
    """A run made before --removal existed has none of its keys in its manifest: a config without removals
    must describe itself the same way (the config fingerprint a resume compares), one with them must not."""
    from gradspec.validation.config import ValidateConfig

    plain = ValidateConfig(target="t.jsonl").describe()
    assert not {"removal", "remove", "removal_files"} & set(plain)
    scores = tmp_path / "s.parquet"
    scores.write_bytes(b"x")
    given = ValidateConfig(target="t.jsonl", removal=(f"{scores}:a",), remove=0.2).describe()
    assert given["removal"] == [f"{scores}:a"] or given["removal"] == (f"{scores}:a",)
    assert given["remove"] == 0.2 and set(given["removal_files"]) == {f"{scores}:a"}
    assert {k: v for k, v in given.items() if k not in ("removal", "remove", "removal_files")} == plain
