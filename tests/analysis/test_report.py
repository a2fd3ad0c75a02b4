import json

import numpy as np
import pandas as pd
import pytest

import gradspec
from gradspec.analysis.report import cohens_d, correlations, per_sample, summary_table
from gradspec.cli import main


def test_cohens_d_by_hand():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])
    pooled = np.sqrt((2 * 1.0 + 2 * 4.0) / 4)
    assert cohens_d(a, b) == pytest.approx((2.0 - 4.0) / pooled)


def test_partial_correlation_removes_a_shared_length_effect():
    rng = np.random.default_rng(0)
    n = 400
    length = rng.uniform(10, 1000, n)
    samples = pd.DataFrame({("effective_rank", "q"): length + rng.normal(0, 50, n)},
                           index=pd.Index([f"g:{i}" for i in range(n)], name="sample"))
    samples.columns = pd.MultiIndex.from_tuples(samples.columns, names=["metric", "module"])
    wide = pd.DataFrame({"sample": samples.index, "index": range(n), "status": "ok",
                         "num_response_tokens": length, "reward": length + rng.normal(0, 50, n)})
    plain, partial = correlations(wide, samples)
    assert plain.loc["effective_rank", "reward"] > 0.8
    assert abs(partial.loc["effective_rank", "reward"]) < 0.15
    assert "num_response_tokens" not in partial.columns


def test_summary_table_means_and_effect():
    idx = pd.MultiIndex.from_tuples([("effective_rank", "q")], names=["metric", "module"])
    hi = pd.DataFrame([[3.0], [4.0], [5.0]], columns=idx)
    lo = pd.DataFrame([[1.0], [2.0], [2.5]], columns=idx)
    t = summary_table({"high": hi, "low": lo})
    assert t.loc[0, "mean high"] == pytest.approx(4.0) and t.loc[0, "mean low"] == pytest.approx(5.5 / 3)
    assert t.loc[0, "d (high - low)"] == pytest.approx(cohens_d(hi.to_numpy()[:, 0], lo.to_numpy()[:, 0]))
    assert 0 < t.loc[0, "Mann-Whitney p"] <= 1


def test_report_from_the_cli(tmp_path, tiny_model_dir):
    files = {}
    for label, n_words in (("long", 30), ("short", 2)):
        data = tmp_path / f"{label}.jsonl"
        data.write_text("".join(json.dumps({"instruction": f"Write about topic {i}.", "output": "word " * (n_words + i),
                                            "reward": float(i)}) + "\n" for i in range(6)))
        files[label] = tmp_path / f"{label}.parquet"
        assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(files[label]),
                     "--modules", "all", "--classic", "--quiet"]) == 0
    out = tmp_path / "report"
    assert main(["report", f"long={files['long']}", f"short={files['short']}", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    for png in ("layers_effective_rank.png", "distribution_nuclear_norm.png", "correlation.png",
                "correlation_partial_length.png"):
        assert (out / png).stat().st_size > 5000 and png in text
    # the table's mean for one module type is the mean over samples of the mean over layers
    _, long = gradspec.read_scores(files["long"])
    q = long[(long["metric"] == "effective_rank") & (long["module"] == "q")]
    want = q.groupby("index")["value"].mean().mean()
    assert f"{want:.3g}" in text
    assert "ifd" in text and "reward" in text
    # the groups differ in length: each group's length and truncated share up top, the length-adjusted d first
    wide, _ = gradspec.read_scores(files["long"])
    top = text.split("## ")[0]
    assert "response tokens, median" in top and "truncated" in top
    assert f" {wide['num_response_tokens'].median():.3g} " in top
    assert "**Length differs:** long's responses are" in text
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    assert header.index("d after length") < header.index("d (long - short)")
    assert main(["report", "bad", "--out", str(out)]) == 2


def test_per_sample_means_over_layers():
    long = pd.DataFrame({"sample": ["a:0"] * 4, "metric": ["m"] * 4, "module": ["q", "q", "k", "k"],
                         "layer": [0, 1, 0, 1], "value": [1.0, 3.0, 5.0, 7.0]})
    s = per_sample(long)
    assert s.loc["a:0", ("m", "q")] == 2.0 and s.loc["a:0", ("m", "k")] == 6.0


def test_the_length_adjusted_effect_takes_out_what_length_explains():
    """A metric that follows log length alone: a large raw d between long and short groups, none after length;
    a metric that differs between the groups but not with length within them keeps its effect (a line pooled
    over both groups took that difference for length: the slope is fitted within the groups)."""
    rng = np.random.default_rng(0)
    n = 200
    frames, wides = {}, {}
    for label, (low, high), shift in (("long", (100, 400), 1.0), ("short", (20, 80), 0.0)):
        length = rng.uniform(low, high, n)
        index = pd.Index([f"{label}:{i}" for i in range(n)], name="sample")
        columns = pd.MultiIndex.from_tuples([("effective_rank", "q"), ("nuclear_norm", "q")],
                                            names=["metric", "module"])
        frames[label] = pd.DataFrame({columns[0]: np.log(length) + rng.normal(0, 0.1, n),
                                      columns[1]: shift + rng.normal(0, 0.5, n)}, index=index)
        wides[label] = pd.DataFrame({"sample": index, "status": "ok", "num_response_tokens": length})
    table = summary_table(frames, wides).set_index("metric")
    assert table.loc["effective_rank", "d (long - short)"] > 3
    assert abs(table.loc["effective_rank", "d after length"]) < 0.3
    raw, adjusted = table.loc["nuclear_norm", ["d (long - short)", "d after length"]]
    assert raw > 1.5 and adjusted == pytest.approx(raw, rel=0.25)


def test_the_length_adjusted_effect_of_rows_without_a_length_leaves_them_out():
    idx = pd.MultiIndex.from_tuples([("effective_rank", "q")], names=["metric", "module"])
    frames, wides = {}, {}
    for label, lengths in (("a", [10.0, 20.0, np.nan, 40.0]), ("b", [5.0, 8.0, 9.0, 12.0])):
        index = pd.Index([f"{label}:{i}" for i in range(4)], name="sample")
        frames[label] = pd.DataFrame({idx[0]: np.log(np.nan_to_num(lengths, nan=30.0)) + [0.1, -0.1, 0.2, 0.0]},
                                     index=index)
        wides[label] = pd.DataFrame({"sample": index, "status": "ok", "num_response_tokens": lengths})
    assert np.isfinite(summary_table(frames, wides).loc[0, "d after length"])


def test_the_per_layer_curves_of_an_moe_run_have_its_experts_and_routers(tmp_path, tiny_moe_dir):
    """Every scored role gets its per-layer panel, the experts' (the mean over a layer's experts) and the routers'."""
    from gradspec.analysis.report import check_group, layer_curves

    out = tmp_path / "moe.parquet"
    assert main(["score", "--model", str(tiny_moe_dir), "--limit", "8", "--out", str(out), "--modules", "all",
                 "--quiet"]) == 0
    curves = layer_curves(check_group("moe", out))
    roles = {role for (_, role), frame in curves.items() if len(frame)}
    assert roles == {"q", "k", "v", "o", "expert_gate", "expert_up", "expert_down", "router"}
    experts = curves[("nuclear_norm", "expert_up")]
    assert len(experts) == 2 and np.isfinite(experts["median"]).all()  # 2 layers, a finite median over experts
    report = tmp_path / "report"
    assert main(["report", f"moe={out}", "--out", str(report)]) == 0


def test_a_layer_curve_is_the_middle_of_its_band_and_numbers_stay_readable(tmp_path):
    """The curves drew a mean inside an interquartile band it left on a skewed metric (low group, q, layers
    13-19); they draw the median now, never outside its band. The heatmap's numbers were black on dark cells."""
    import matplotlib.pyplot as plt
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gradspec.analysis.report import QUARTILES, check_group, layer_curves, text_color

    skewed = np.r_[np.ones(9), 1000.0]  # nine rows at 1, one at 1000: the mean (100.9) lies above the band
    part = {"name": "model.layers.0.self_attn.q_proj", "role": "q", "layer": 0}
    table = pa.table({"index": np.arange(10), "status": ["ok"] * 10, "num_tokens": np.full(10, 8),
                      "num_response_tokens": np.full(10, 4), f"{part['name']}/effective_rank": skewed})
    meta = {"parts": [part], "metrics": ["effective_rank"], "data": "d.jsonl"}
    path = tmp_path / "s.parquet"
    pq.write_table(table.replace_schema_metadata({"gradspec": json.dumps(meta)}), path)
    curve = layer_curves(check_group("low", path))[("effective_rank", "q")]
    assert list(curve.columns) == [q for q, _ in QUARTILES]
    assert curve.loc[0].tolist() == [1.0, 1.0, 1.0] and skewed.mean() > curve.loc[0, "hi"]
    cmap = plt.get_cmap("RdBu_r")
    assert [text_color(cmap(x)) for x in (0.0, 0.5, 1.0)] == ["white", "black", "white"]  # -1, 0 and 1
