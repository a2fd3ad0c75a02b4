"""The LDS beyond length: the partial Spearman correlation against a slow reference, and planted retrain
files where the answer is known (a score that is length plus noise has nothing beyond length; a planted
helpful score keeps its LDS), through the analysis and the report."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from gradspec.cli import main
from gradspec.runs.score_files import write_parquet
from gradspec.validation.lds import RESPONSE_TOKENS, partial_lds, partial_spearman_columns
from gradspec.validation.report import LENGTH_SCORE, analyse, summary
from gradspec.validation.subsets import lds_subset

ROWS, SUBSETS, TARGETS = 48, 40, 3


def _reference_partial(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> float:
    """The partial correlation the slow way: the ranks of x and y regressed on z's ranks, then Pearson's
    correlation of the residuals."""
    rx, ry, rz = (stats.rankdata(v) for v in (x, y, z))
    design = np.column_stack([np.ones_like(rz), rz])

    def residual(v):
        return v - design @ np.linalg.lstsq(design, v, rcond=None)[0]

    return float(stats.pearsonr(residual(rx), residual(ry))[0])


def test_the_partial_correlation_is_the_correlation_of_the_residuals():
    rng = np.random.default_rng(0)
    z = rng.normal(size=30)
    x = np.column_stack([z + rng.normal(size=30), rng.normal(size=30)])
    y = np.column_stack([z + x[:, 0] + rng.normal(size=30), np.round(rng.normal(size=30))])  # ties too
    got = partial_spearman_columns(x, y, z[:, None])
    for j in range(2):
        assert got[j] == pytest.approx(_reference_partial(x[:, j], y[:, j], z), abs=1e-12)
    assert np.isnan(partial_spearman_columns(3 * z[:, None] + 1, y[:, :1], z[:, None])).all()  # z itself: none


def _planted(tmp_path, recorded: bool = True):
    """A retrain file whose losses fall with the subset's length and with its planted helpful rows, and
    score files: length plus noise, the planted rows, and noise alone."""
    rng = np.random.default_rng(53)
    tokens = rng.integers(10, 400, ROWS)
    helpful = np.zeros(ROWS)
    helpful[rng.choice(ROWS, 12, replace=False)] = 1.0
    pool = list(range(ROWS))
    members = [lds_subset(pool, 0.5, 0, k) for k in range(SUBSETS)]
    length = np.array([tokens[m].sum() for m in members], dtype=float)
    useful = np.array([helpful[m].sum() for m in members])
    base = 3.0 - length / length.std() * 0.1 - useful / useful.std() * 0.1
    losses = base[:, None] + rng.normal(0, 0.02, (SUBSETS, TARGETS))
    frame = pd.DataFrame({"index": range(SUBSETS), "kind": "lds", "subset": range(SUBSETS), "members": members,
                          "target_loss": [list(v) for v in losses]})
    meta = {"rows": ROWS, "targets": TARGETS, "target": "t.jsonl", "pool": ROWS}
    if recorded:
        meta[RESPONSE_TOKENS] = [int(t) for t in tokens]
    retrains = tmp_path / ("retrains.parquet" if recorded else "old.parquet")
    write_parquet(frame, retrains, meta)
    scores = tmp_path / "scores.parquet"
    pd.DataFrame({"index": pool, "length_and_noise": tokens + rng.normal(0, tokens.std() * 0.5, ROWS),
                  "planted": helpful, "noise": rng.normal(size=ROWS)}).to_parquet(scores)
    return retrains, scores, length, losses


def test_a_planted_score_keeps_its_lds_beyond_length_and_length_plus_noise_has_none(tmp_path):
    retrains, scores, length, losses = _planted(tmp_path)
    specs = [f"{scores}:{c}" for c in ("length_and_noise", "planted", "noise")]
    table = analyse([str(retrains)], specs, resamples=400).lds.set_index("score")
    assert table.index.tolist() == [LENGTH_SCORE, "scores:length_and_noise", "scores:planted", "scores:noise"]
    noisy, planted, noise = (table.loc[f"scores:{c}"] for c in ("length_and_noise", "planted", "noise"))
    assert noisy["low"] > 0  # length plus noise predicts the retrains ...
    assert noisy["beyond_low"] < 0 < noisy["beyond_high"]  # ... and nothing beyond length
    assert planted["low"] > 0.3 and planted["beyond_low"] > 0.3  # the planted rows keep their LDS
    assert planted["beyond_length"] > noisy["beyond_high"]
    assert noise["beyond_low"] < 0 < noise["beyond_high"]
    assert table.loc[LENGTH_SCORE, "low"] > 0.3 and np.isnan(table.loc[LENGTH_SCORE, "beyond_length"])
    mean = np.nanmean(losses, axis=1, keepdims=True)  # the table's number is lds.partial_lds's
    prediction = np.array([[planted_sum] for planted_sum in _sums(scores, "planted", retrains)])
    assert planted["beyond_length"] == pytest.approx(partial_lds(prediction, mean, length, resamples=400).value)


def _sums(scores, column, retrains):
    values = pd.read_parquet(scores)[column].to_numpy()
    return [values[list(m)].sum() for m in pd.read_parquet(retrains)["members"]]


def test_the_report_and_the_terminal_give_the_lds_beyond_length(tmp_path, capsys):
    retrains, scores, _, _ = _planted(tmp_path)
    assert main(["validate", "--runs", str(retrains), "--scores", f"{scores}:planted", f"{scores}:length_and_noise",
                 "--report", str(tmp_path / "report"), "--resamples", "200"]) == 0
    printed = capsys.readouterr().out
    assert f"{LENGTH_SCORE}: " in printed and "beyond length: - (the control itself)" in printed
    assert "scores:planted: " in printed and "; beyond length +" in printed and "nan" not in printed
    report = (tmp_path / "report" / "report.md").read_text()
    assert "beyond_length" in report and "each subset's total response tokens" in report
    assert "NaN for length's own row (the control they take out)" in report
    assert "beyond_low" in pd.read_csv(tmp_path / "report" / "lds.csv")


def test_a_file_without_the_counts_says_it_has_no_lds_beyond_length(tmp_path, capsys):
    old, scores, _, _ = _planted(tmp_path, recorded=False)
    table = analyse([str(old)], [f"{scores}:planted"], resamples=100).lds
    assert table["score"].tolist() == ["scores:planted"] and "beyond_length" not in table
    assert main(["validate", "--runs", str(old), "--scores", f"{scores}:planted", "--resamples", "100"]) == 0
    assert f"no LDS beyond length: {old} does not record its rows' response tokens" in capsys.readouterr().out


def test_files_that_count_the_rows_differently_are_analysed_apart(tmp_path):
    first, scores, _, _ = _planted(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    second, _, _, _ = _planted(other)
    frame = pd.read_parquet(second)
    meta = {"rows": ROWS, "targets": TARGETS, "target": "t.jsonl", "pool": ROWS,
            RESPONSE_TOKENS: [1] * ROWS}
    write_parquet(frame, second, meta)
    with pytest.raises(Exception, match="other response-token counts"):
        analyse([str(first), str(second)], [f"{scores}:planted"], resamples=50)
    old, _, _, _ = _planted(other, recorded=False)  # one file without the counts: nothing beyond length
    analysis = analyse([str(first), str(old)], [f"{scores}:planted"], resamples=50)
    assert not analysis.beyond_length and f"{old} does not record" in summary(analysis)
