import json

import pandas as pd

from gradspec.cli import main
from gradspec.runs.summary import module_means

ROWS = [{"instruction": f"Task {i}: repeat {w}", "output": f"{w} " * (i + 2)} for i, w in enumerate(["a", "b", "c"])]


def test_score_ends_with_a_summary_and_the_next_commands(tmp_path, tiny_model_dir, capsys):
    data, out = tmp_path / "d.jsonl", tmp_path / "s.parquet"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + json.dumps({"instruction": "q", "output": ""}))
    from transformers.utils import logging as hf_logging

    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--quiet"]) == 0
    printed, err = capsys.readouterr()
    assert f"wrote 4 rows to {out}: 3 ok, 1 empty_response" in printed
    assert "Loading weights" not in err and hf_logging.is_progress_bar_enabled()  # hidden, then as found
    means = module_means(out)
    assert list(means.index) == ["q", "k", "v", "o"]
    assert list(means.columns) == ["nuclear_norm", "effective_rank", "spectral_norm"]
    df = pd.read_parquet(out)
    ok = df[df["status"] == "ok"]
    er_q = ok[[c for c in df.columns if c.endswith("q_proj/effective_rank")]].to_numpy().mean()
    assert abs(means.loc["q", "effective_rank"] - er_q) < 1e-9  # mean over complete rows and layers
    assert f"{means.loc['q', 'effective_rank']:.4g}" in printed
    assert f"gradspec report mine={out} other=<another score file> --out report" in printed
    assert f"gradspec select --scores {out} --by effective_rank --count 1 --out best.jsonl   # keep the top 1 of 3 " \
           "complete rows" in printed


def test_a_shard_says_how_to_merge(tmp_path, tiny_model_dir, capsys):
    data, out = tmp_path / "d.jsonl", tmp_path / "s.parquet"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--quiet",
                 "--shard", "0/2", "--chunk-rows", "1"]) == 0
    assert f"when all are done: gradspec merge --out {out}" in capsys.readouterr().out
    # a shard none of whose chunks holds a row (shards take whole chunks) says so plainly
    other = tmp_path / "t.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(other), "--quiet",
                 "--shard", "1/2"]) == 0
    assert f"wrote no rows to {other}.parts; when all are done" in capsys.readouterr().out


def test_the_summary_after_a_resume_counts_the_whole_file(tmp_path, tiny_model_dir, capsys):
    """A resume that only merges what an earlier run scored says how many rows the file holds."""
    data, out = tmp_path / "d.jsonl", tmp_path / "s.parquet"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--quiet",
              "--chunk-rows", "1"]
    assert main([*common, "--no-merge"]) == 0 and main([*common, "--resume"]) == 0
    assert f"wrote 3 rows to {out}: 3 ok" in capsys.readouterr().out


def test_a_classic_run_s_summary_gives_its_classic_scores(tmp_path, tiny_model_dir, capsys):
    """--classic adds IFD, perplexity and the like: the summary listed only the spectra's means."""
    data, out = tmp_path / "d.jsonl", tmp_path / "s.parquet"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--quiet",
                 "--classic"]) == 0
    printed = capsys.readouterr().out
    df = pd.read_parquet(out)
    medians = ", ".join(f"{c} {df[c].median():.4g}" for c in ("perplexity", "ifd", "superfiltering_ifd",
                                                               "mean_entropy", "token_accuracy"))
    assert f"classic scores, median over complete rows: {medians}\n" in printed
