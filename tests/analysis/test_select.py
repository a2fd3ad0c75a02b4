import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.analysis.select import choose, combined_score, criteria, criterion_values, write_selection
from gradspec.cli import main


def _scores():
    return pd.DataFrame({
        "index": range(6),
        "status": ["ok", "ok", "ok", "prompt_too_long", "ok", "ok"],
        "num_tokens": [10, 20, 30, 40, 50, 60],
        "loss": [1.0, 2.0, 3.0, np.nan, 5.0, 6.0],
        "a.q/effective_rank": [1.0, 5.0, 3.0, np.nan, 2.0, 4.0],
        "a.k/effective_rank": [3.0, 5.0, 1.0, np.nan, 2.0, 4.0],
        "a.q/nuclear_norm": [6.0, 5.0, 4.0, np.nan, 3.0, 2.0],
    })


def test_metric_name_averages_modules_and_combination_uses_z_scores():
    s = _scores()
    assert criterion_values(s, "effective_rank").tolist()[:3] == [2.0, 5.0, 2.0]
    combo = combined_score(s, "effective_rank:1,nuclear_norm:-1")
    er, nn = criterion_values(s, "effective_rank"), s["a.q/nuclear_norm"]
    want = (er - er.mean()) / er.std(ddof=0) - (nn - nn.mean()) / nn.std(ddof=0)
    np.testing.assert_allclose(combo, want)
    with pytest.raises(ValueError, match="unknown criterion 'rank'.*effective_rank"):
        criterion_values(s, "rank")


def test_choose_top_bottom_and_only_scored_rows():
    s = _scores()
    assert choose(s, "effective_rank", top=True, count=2)["index"].tolist() == [1, 5]
    assert choose(s, "loss", top=False, fraction=0.4)["index"].tolist() == [0, 1]
    assert 3 not in choose(s, "loss", top=True, fraction=1.0)["index"].tolist()


def test_only_complete_rows_compete():
    """Rows scored whole compete, flagged by the tokenizer or not; unscored rows and rows with a
    numeric flag never do."""
    s = _scores().assign(status=["ok", "boundary_merge", "ok", "no_response_tokens", "boundary_merge;zero_gradient",
                                 "empty_prompt"])
    assert choose(s, "loss", top=True, fraction=1.0)["index"].tolist() == [0, 1, 2, 5]


def test_a_flag_of_an_undefined_score_keeps_a_row_out_only_where_that_score_is_read(caplog):
    """ifd_undefined (alignment_undefined) says one score is undefined, the spectra are whole: the row competes by
    effective_rank, not by ifd (alignment); a --count beyond the competing rows is said, not silent."""
    s = _scores().assign(status=["ok", "ifd_undefined", "ok", "ok", "boundary_merge;alignment_undefined", "ok"],
                         ifd=[0.1, np.nan, 0.3, 0.4, 0.5, 0.6], align_mean=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    s.loc[3, "a.q/effective_rank"] = s.loc[3, "a.k/effective_rank"] = 1.0
    assert choose(s, "effective_rank", fraction=1.0)["index"].tolist() == list(range(6))
    assert choose(s, "ifd", fraction=1.0)["index"].tolist() == [0, 2, 3, 4, 5]
    assert choose(s, "alignment", fraction=1.0)["index"].tolist() == [0, 1, 2, 3, 5]
    assert choose(s, "effective_rank:1,ifd:1", fraction=1.0)["index"].tolist() == [0, 2, 3, 4, 5]
    with caplog.at_level("WARNING", logger="gradspec"):
        assert len(choose(s, "ifd", count=100)) == 5
    assert "--count 100: only 5 rows compete" in caplog.text


def test_length_buckets_choose_within_each_bucket():
    s = _scores()  # loss grows with length: unstratified top picks the longest
    assert choose(s, "loss", count=2)["index"].tolist() == [4, 5]
    assert choose(s, "loss", count=2, length_buckets=2)["index"].tolist() == [2, 5]


def _bucket_counts(chosen, scores, buckets):
    """How many chosen rows each length quantile holds."""
    bucket = pd.qcut(scores["num_tokens"].rank(method="first"), buckets, labels=False)
    return bucket[chosen.index].value_counts().reindex(range(buckets), fill_value=0).tolist()


@pytest.mark.parametrize("size", [{"count": 10}, {"fraction": 0.5}])
def test_length_buckets_keep_the_size_asked_for(size):
    """10 of 20 rows over 4 buckets of 5 is 2.5 a bucket: the odd rows go to the buckets whose next rows score
    best, not lost to rounding (each bucket rounding its own share wrote 8)."""
    s = pd.DataFrame({"index": range(20), "status": "ok", "num_tokens": range(10, 30),
                      "loss": np.random.default_rng(0).random(20)})
    chosen = choose(s, "loss", length_buckets=4, **size)
    assert len(chosen) == 10
    assert sorted(_bucket_counts(chosen, s, 4)) == [2, 2, 3, 3]
    within = s.assign(bucket=pd.qcut(s["num_tokens"].rank(method="first"), 4, labels=False))
    for bucket, rows in within.groupby("bucket"):  # each bucket's best rows, however many it gives
        kept = _bucket_counts(chosen, s, 4)[bucket]
        assert set(chosen.index) & set(rows.index) == set(rows.nlargest(kept, "loss").index)
    thirds = s.assign(loss=[3.0, 2.0, 1.0, 0.0, 0.0] * 4)  # every bucket's third row ties: input order
    assert choose(thirds, "loss", count=10, length_buckets=4)["index"].tolist() == [0, 1, 2, 5, 6, 7, 10, 11, 15, 16]


def test_a_short_bucket_gives_its_share_to_the_others():
    """7 rows in 4 buckets (2, 2, 1, 2): 6 rows take the short bucket's one row and 5 of the other 6."""
    s = pd.DataFrame({"index": range(7), "status": "ok", "num_tokens": range(7),
                      "loss": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]})
    chosen = choose(s, "loss", count=6, length_buckets=4)
    assert len(chosen) == 6 and _bucket_counts(chosen, s, 4) == [1, 2, 1, 2]
    assert len(choose(s, "loss", count=10, length_buckets=4)) == 7  # fewer eligible rows than asked: all of them
    assert len(choose(s.head(3), "loss", count=2, length_buckets=5)) == 2  # more buckets than rows


ROWS = [{"instruction": f"Task {i}: say {w}", "output": f"{w} " * (i + 1), "reward": float(i)}
        for i, w in enumerate(["yes", "no", "maybe", "sure", "never", "ok"])]


def _write(path, rows):
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))


def _read(path):
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    import datasets

    return datasets.load_from_disk(str(path)).to_list()


@pytest.mark.parametrize("name", ["d.json", "d.jsonl", "d.parquet", "ds"])
def test_select_writes_the_format_the_output_asks_for(tmp_path, tiny_model_dir, name, capsys):
    """From every input format to every output format (a name without a suffix: a datasets folder)."""
    pytest.importorskip("datasets")
    data, scores = tmp_path / name, tmp_path / "s.parquet"
    _write(data, ROWS)
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(scores), "--quiet"]) == 0
    df = pd.read_parquet(scores)
    er = criterion_values(df, "effective_rank")
    want = sorted(df.loc[er.sort_values(ascending=False).index[:3], "index"].tolist())
    for out in (tmp_path / "chosen.json", tmp_path / "chosen.jsonl", tmp_path / "chosen.parquet", tmp_path / "chosen"):
        capsys.readouterr()
        assert main(["select", "--scores", str(scores), "--out", str(out), "--by", "effective_rank",
                     "--count", "3"]) == 0
        printed = capsys.readouterr().out
        assert "wrote 3 of 6 rows to " + str(out) + " (only complete rows compete; left out: none)" in printed
        chosen = _read(out)
        assert [r["reward"] for r in chosen] == [float(i) for i in want]  # input order, input fields kept
        for r in chosen:
            original = ROWS[int(r["reward"])]
            assert {k: r[k] for k in original} == original
            assert r["effective_rank"] == pytest.approx(er[int(r["reward"])]) and "gradspec_score" in r
            assert type(r["num_tokens"]) is int  # not the float a row of mixed columns made of it


def test_select_errors_are_clear(tmp_path, tiny_model_dir, capsys):
    data, scores = tmp_path / "d.jsonl", tmp_path / "s.parquet"
    _write(data, ROWS)
    main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(scores), "--quiet"])
    capsys.readouterr()
    assert main(["select", "--scores", str(scores), "--out", str(tmp_path / "o.csv"), "--by", "loss",
                 "--count", "1"]) == 2
    assert "--out " + str(tmp_path / "o.csv") + ": write .jsonl, .json, .parquet, or a name without a suffix" \
        in capsys.readouterr().err
    assert main(["select", "--scores", str(scores), "--out", str(tmp_path / "o.jsonl"), "--by", "rank",
                 "--count", "1"]) == 2
    assert "unknown criterion" in capsys.readouterr().err


def test_select_writes_count_rows_over_length_buckets(tmp_path, tiny_model_dir, capsys):
    """The command line as the issue met it: --count 10 --length-buckets 4 of 20 rows writes 10."""
    rows = [{"instruction": f"Task {i}: say {i}", "output": "yes " * (i + 1), "id": i} for i in range(20)]
    data, scores, out = tmp_path / "d.jsonl", tmp_path / "s.parquet", tmp_path / "chosen.jsonl"
    _write(data, rows)
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(scores), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["select", "--scores", str(scores), "--out", str(out), "--by", "loss", "--count", "10",
                 "--length-buckets", "4"]) == 0
    assert "wrote 10 of 20 rows" in capsys.readouterr().out
    assert len(_read(out)) == 10


@pytest.mark.parametrize(("by", "message"), [
    ("effective_rank:", "by 'effective_rank:': weight '' of 'effective_rank' is not a number"),
    ("effective_rank:x", "by 'effective_rank:x': weight 'x' of 'effective_rank' is not a number"),
    ("effective_rank:nan", "by 'effective_rank:nan': weight 'nan' of 'effective_rank' is not a finite number"),
    (":1", "by ':1': ':1' names no criterion"),
    (" , ", "by names no criterion"),
])
def test_criteria_are_read_strictly(by, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        criteria(by)
    assert criteria("effective_rank: 2, loss") == [("effective_rank", 2.0), ("loss", 1.0)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_selection_whose_records_hold_text_utf8_cannot_is_written_escaped(tmp_path, suffix):
    """A lone surrogate in a column gradspec does not read (nested here) reaches the selection as it
    is: written as its JSON escape, not a UnicodeEncodeError after the scores were read."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b", "meta": {"note": "x \\ud800"}}\n'
                    '{"instruction": "c", "output": "d", "meta": {"note": "caf\u00e9"}}\n', encoding="utf-8")
    out = tmp_path / f"best{suffix}"
    chosen = pd.DataFrame({"index": [0, 1], "effective_rank": [2.0, 1.0]})
    assert write_selection(data, chosen, out, ["effective_rank"]) == 2
    text = out.read_text(encoding="utf-8")
    assert "\\ud800" in text and ("café" in text) == (suffix == ".jsonl")  # escaped record by record in JSONL
    rows = [json.loads(line) for line in text.splitlines()] if suffix == ".jsonl" else json.loads(text)
    assert rows[0]["meta"]["note"] == "x \ud800" and rows[1]["effective_rank"] == 1.0
