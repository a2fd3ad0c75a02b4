import json
import math
import re

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

import gradspec
from gradspec.cli import main
from gradspec.data import batching
from gradspec.data.errors import InputError
from gradspec.linalg.metrics import METRICS

ROWS = [
    {"instruction": "Write a haiku about rain.", "output": "Soft rain on the roof,\nquiet streets.", "reward": 0.7},
    {"instruction": "What is 2+2?", "output": "4", "reward": 1.0, "id": 11},
    {"instruction": "Describe it", "input": "a cat", "output": "", "reward": -1.0},
    {"instruction": "word " * 300, "output": "too late", "reward": 0.1},
    {"instruction": "Name a prime.", "output": "Seven is a prime number.", "reward": 0.3},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_score_writes_one_row_per_sample_in_order(tmp_path, tiny_model_dir):
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "s.parquet"
    df = gradspec.score(data, str(tiny_model_dir), out, max_length=64, batch_tokens=100,
                        modules="all", save_spectra=True, progress=False)
    assert df["index"].tolist() == [0, 1, 2, 3, 4]
    assert df["status"].tolist() == ["ok", "ok", "empty_response", "prompt_too_long", "ok"]
    assert df["reward"].tolist() == [0.7, 1.0, -1.0, 0.1, 0.3]
    assert df["id"].isna().tolist() == [True, False, True, True, True]
    q = "model.layers.0.self_attn.q_proj"
    assert df.loc[[0, 1, 4], f"{q}/effective_rank"].gt(1).all()
    assert df.loc[[2, 3], f"{q}/effective_rank"].isna().all() and math.isnan(df.loc[3, "loss"])
    assert df.loc[3, "num_tokens"] == 64 and df.loc[3, "num_response_tokens"] == 0
    sigma = df.loc[1, f"{q}/singular_values"]
    assert sum(sigma) == pytest.approx(df.loc[1, f"{q}/nuclear_norm"])
    assert len([c for c in df.columns if c.endswith("/nuclear_norm")]) == 14  # 2 layers x q,k,v,o,gate,up,down

    wide, long = gradspec.read_scores(out)
    pd.testing.assert_frame_equal(wide, df)
    assert set(long["module"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert set(long["metric"]) == set(METRICS) and set(long["layer"]) == {0, 1}
    one = long.query("index == 1 and layer == 0 and module == 'q' and metric == 'nuclear_norm'")
    assert one["value"].item() == df.loc[1, f"{q}/nuclear_norm"]


def test_scores_match_the_engine_whatever_the_batching(tmp_path, tiny_model_dir):
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    small = gradspec.score(data, str(tiny_model_dir), None, max_length=64, batch_tokens=1, progress=False)
    large = gradspec.score(data, str(tiny_model_dir), None, max_length=64, batch_tokens=10_000, progress=False)
    cols = [c for c in small.columns if "/" in c]
    pd.testing.assert_frame_equal(small[cols], large[cols], rtol=1e-5)


def test_bad_line_keeps_rows_already_written(tmp_path, tiny_model_dir):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2] + ROWS[4:]) + "{broken\n")
    out = tmp_path / "s.parquet"
    with pytest.raises(InputError, match=rf"{path}:4: malformed JSON.*; on_error skip scores the other rows and "
                                         "lists the bad ones"):
        gradspec.score(path, str(tiny_model_dir), out, progress=False, chunk_rows=2)
    kept = pq.read_table(tmp_path / "s.parquet.parts" / "00000000.parquet").to_pandas()
    assert kept["index"].tolist() == [0, 1] and (kept["status"] == "ok").all() and not out.exists()


def test_carried_columns_that_clash_are_renamed(tmp_path, tiny_model_dir):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b", "loss": 5, "index": "x"}])
    df = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    assert df.loc[0, "input_loss"] == 5 and df.loc[0, "input_index"] == "x" and df.loc[0, "index"] == 0


def test_cli_score_and_errors(tmp_path, tiny_model_dir, capsys):
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS[:2])
    out = tmp_path / "s.parquet"
    args = ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--quiet"]
    assert main(args) == 0
    assert "wrote 2 rows" in capsys.readouterr().out
    assert main(args) == 2  # refuses to overwrite
    assert "exists" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    other = ["score", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "t.parquet")]
    assert main([*other, "--modules", "*.nope", "--quiet"]) == 2
    assert "no module matches" in capsys.readouterr().err
    assert main(["score", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "u.parquet")]) == 2
    assert "no such folder, and not a Hub model id" in capsys.readouterr().err


def test_token_batches_respect_budget_and_padding():
    from gradspec.data.readers import Sample
    from gradspec.data.templates import Tokenized

    lengths = [5, 100, 7, 6, 50, 52, 8, 51, 300]
    items = [batching.Item(Sample(i, []), Tokenized([0] * n, [0] * n, "ok")) for i, n in enumerate(lengths)]
    batches = list(batching.token_batches(items, batch_tokens=160, max_padding=0.2))
    assert sorted(i.sample.index for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        sizes = [i.tokens.num_tokens for i in b]
        assert len(b) == 1 or (len(b) * max(sizes) <= 160 and sum(sizes) >= 0.8 * len(b) * max(sizes))
    assert [[i.tokens.num_tokens for i in b] for b in batches] == [[5, 6, 7, 8], [50, 51, 52], [100], [300]]


def test_out_of_memory_splits_the_batch_then_flags(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """A batch that runs out of memory is retried in halves; a lone sample that still does not
    fit (here: the longest) gets status out_of_memory, and the others are scored as usual."""
    real_submit = gradspec.SpectralEngine.submit

    def submit_or_oom(self, input_ids, attention_mask, labels):
        if input_ids.shape[0] > 1 or input_ids.shape[1] > 30:
            raise torch.OutOfMemoryError("simulated")
        return real_submit(self, input_ids, attention_mask, labels)

    rows = [{"instruction": "Hi", "output": "Hello"}, {"instruction": "Yo", "output": "Hey there"},
            {"instruction": "a long one " * 20, "output": "reply"}]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    want = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    monkeypatch.setattr(gradspec.SpectralEngine, "submit", submit_or_oom)
    with caplog.at_level("WARNING", logger="gradspec"):
        got = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    assert got["status"].tolist() == ["ok", "ok", f"{want['status'][2]};out_of_memory"]  # boundary_merge kept
    assert "retrying it in two halves" in caplog.text
    cols = [c for c in got.columns if "/" in c]
    pd.testing.assert_frame_equal(got.loc[:1, cols], want.loc[:1, cols], rtol=1e-5)


def test_an_out_of_memory_retry_runs_after_the_failed_pass_is_freed():
    """The halves are retried once the failed pass's frames (graph, Grams) are gone: retried inside the
    except block, they would run with that memory held, and fail down to single samples."""
    import weakref

    from gradspec.data.readers import Sample
    from gradspec.data.templates import Tokenized
    from gradspec.runs.chunks import submit_with_split

    held, alive_at_call = [], []

    class Engine:
        lockstep = None  # not under --fsdp: a batch out of memory is retried in halves

        def submit(self, input_ids, attention_mask, labels):
            alive_at_call.append(sum(r() is not None for r in held))
            if input_ids.shape[0] > 1:
                activations = torch.zeros(1000)  # the failed pass's memory, referenced by its frame
                held.append(weakref.ref(activations))
                raise torch.OutOfMemoryError("CUDA out of memory")
            return "future"

    items = [batching.Item(Sample(i, []), Tokenized([1] * 4, [1] * 4, "ok")) for i in range(4)]
    got = submit_with_split(Engine(), items, pad_id=0)
    assert [(item.sample.index, future) for item, future, _ in got] == [(i, "future") for i in range(4)]
    assert alive_at_call == [0] * 7  # 4, 2, 1, 1, 2, 1, 1: no earlier attempt alive at any call


def test_a_batch_out_of_memory_after_its_pass_is_flagged_not_fatal():
    from concurrent.futures import Future

    from gradspec.data.readers import Sample
    from gradspec.data.templates import Tokenized
    from gradspec.runs.rows import collect

    failed = Future()
    failed.set_exception(torch.OutOfMemoryError("CUDA out of memory"))
    items = [batching.Item(Sample(i, []), Tokenized([1] * 3, [1] * 3, "ok")) for i in range(2)]
    rows = {i: {"status": "ok"} for i in range(2)}
    assert collect([(items[0], failed, 0), (items[1], failed, 1)], rows, ()) == 6
    assert [r["status"] for r in rows.values()] == ["out_of_memory", "out_of_memory"]


def test_lowrank_method_writes_topk_energy(tmp_path, tiny_model_dir):
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS[:2])
    out = tmp_path / "s.parquet"
    df = gradspec.score(data, str(tiny_model_dir), out, method="lowrank", rank=4, progress=False)
    q = "model.layers.0.self_attn.q_proj"
    assert df[f"{q}/topk_energy"].between(0, 1 + 1e-9).all()
    _, long = gradspec.read_scores(out)
    assert "topk_energy" in set(long["metric"])


def test_under_lockstep_an_out_of_memory_pass_is_not_retried_alone():
    """Under --fsdp the peers wait in the failed pass's collectives: a retry of halves would cross them."""
    from gradspec.data.readers import Sample
    from gradspec.data.templates import Tokenized
    from gradspec.runs.chunks import submit_with_split

    class Engine:
        lockstep = object()

        def submit(self, input_ids, attention_mask, labels):
            raise torch.OutOfMemoryError("CUDA out of memory")

    items = [batching.Item(Sample(i, []), Tokenized([1] * 4, [1] * 4, "ok")) for i in range(2)]
    with pytest.raises(torch.OutOfMemoryError):
        submit_with_split(Engine(), items, pad_id=0)


def test_a_sample_that_cannot_fit_the_memory_budget_is_flagged_before_it_runs(tmp_path, tiny_model_dir, monkeypatch,
                                                                            caplog):
    """On the host a pass past the RAM is no error to catch (the kernel kills the process): a sample whose own
    estimate exceeds the budget (lowered here, between the short rows' and the long row's) is flagged
    out_of_memory with its estimate and never run; the rest are scored as usual."""
    from gradspec.data.batching import pad_id_of
    from gradspec.data.models import load_model
    from gradspec.engine import batch_memory

    rows = [{"instruction": "Hi", "output": "Hello"}, {"instruction": "Yo", "output": "Hey there"},
            {"instruction": "a long one " * 60, "output": "reply"}]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    want = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    model, tokenizer = load_model(str(tiny_model_dir), progress=False)
    memory = batch_memory.measure(gradspec.SpectralEngine(model, "attn"), pad_id_of(tokenizer))
    short, long = sorted(want["num_tokens"])[1], want["num_tokens"].max()
    monkeypatch.setattr(batch_memory, "budget", lambda device: (memory.bytes(1, short) + memory.bytes(1, long)) / 2)
    lengths = []
    real_submit = gradspec.SpectralEngine.submit
    monkeypatch.setattr(gradspec.SpectralEngine, "submit", lambda self, ids, *a: lengths.append(ids.shape[1])
                        or real_submit(self, ids, *a))
    with caplog.at_level("WARNING", logger="gradspec"):
        got = gradspec.score(data, str(tiny_model_dir), None, progress=False)
    flagged = f"{want['status'][2]};out_of_memory"  # its tokenizer's flag (here boundary_merge) kept beside it
    assert got["status"].tolist() == ["ok", "ok", flagged] and max(lengths) < long
    assert f"sample 2 ({long} tokens) needs about" in caplog.text and "flagged out_of_memory, not run" in caplog.text
    cols = [c for c in got.columns if "/" in c]
    pd.testing.assert_frame_equal(got.loc[:1, cols], want.loc[:1, cols], rtol=1e-5)
    fits = int(re.search(r"--max-length (\d+) or less would fit it", caplog.text)[1])  # the way out, named
    assert memory.fits(1, fits, batch_memory.budget("cpu")) and not memory.fits(1, fits + 1, batch_memory.budget("cpu"))
    rows[2] = {"instruction": "Yo", "output": "a long one " * 80}  # its response cut, its prompt whole
    cut = gradspec.score(_write_jsonl(tmp_path / "cut.jsonl", rows), str(tiny_model_dir), None, progress=False,
                         max_length=long)
    flags = cut["status"][2].split(";")  # its cut kept beside the flag (it was lost)
    assert "truncated" in flags and flags[-1] == "out_of_memory"


def test_the_progress_bar_shows_no_rate_before_its_first_tokens():
    """tok_s=0 stood there for minutes while the first CPU batch ran: no rate until there is one."""
    from gradspec.runs.chunks import _Progress

    progress = _Progress(10, enabled=True)
    progress.advance(0, 0)
    assert "tok_s" not in str(progress.bar.postfix or "")
    progress.advance(2, 500)
    assert "tok_s=" in progress.bar.postfix and "tok_s=0" not in progress.bar.postfix
    progress.bar.close()
