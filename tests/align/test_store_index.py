"""A store's FAISS index: `project --index` writes it, `align --store --top K` answers from it with the exact
scan's rows and values, and a damaged, truncated, foreign or linked index is refused naming the file."""

import hashlib
import json
import os
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("faiss")

from gradspec.cli import main  # noqa: E402
from gradspec.errors import InputError  # noqa: E402
from gradspec.runs import store_index  # noqa: E402
from gradspec.runs.score_files import METADATA_KEY, PROJECTION, read_metadata  # noqa: E402
from gradspec.runs.store_index import build_index, index_path, read_index, vectors_path  # noqa: E402
from gradspec.runs.store_query import kept_columns, ranked_by, scanned, top_rows  # noqa: E402

ROWS = [("Add {a} and {b}.", "{a} + {b} = {c}"), ("What is {a} times {b}?", "{c}"), ("Name a colour {a}.", "red")]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir):
    """A real store of 13 rows (one without response tokens) from the tiny model, then its index, built as the
    docs say for a store already written (--resume --index)."""
    root = tmp_path_factory.mktemp("indexed")
    rows = [{"instruction": q.format(a=a, b=b), "output": r.format(a=a, b=b, c=a + b)}
            for a, b in [(1, 2), (3, 9), (5, 5), (7, 1)] for q, r in ROWS]
    rows.insert(4, {"instruction": "Say nothing.", "output": ""})
    (root / "pool.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"instruction": "Sum 2 and 2.", "output": "4"}, {"instruction": "What is 7+1?", "output": "8"}]))
    out = root / "store.parquet"
    command = ["project", "--data", str(root / "pool.jsonl"), "--model", str(tiny_model_dir), "--out", str(out),
               "--k", "2", "--quiet", "--max-length", "64"]
    assert main(command) == 0 and not index_path(out).exists()
    assert main([*command, "--resume", "--index"]) == 0
    assert index_path(out).is_file() and vectors_path(out).is_file()
    return out


def test_top_rows_are_the_exact_scans(store, tmp_path, capsys):
    """--top K gives the exact scan's K best rows by ranked_by, best first, with the same columns and values."""
    task = store.parent / "task.jsonl"
    exact, top = tmp_path / "exact.parquet", tmp_path / "top.parquet"
    assert main(["align", "--store", str(store), "--target", str(task), "--out", str(exact), "--aggregate",
                 "mean_gradient,mean,max"]) == 0
    everything = pd.read_parquet(exact)
    for aggregate in ["mean_gradient,mean", "mean_gradient", "max"]:
        assert main(["align", "--store", str(store), "--target", str(task), "--out", str(top), "--aggregate",
                     aggregate, "--top", "5", "--overwrite"]) == 0
        printed = capsys.readouterr().out
        by = ranked_by(tuple(aggregate.split(",")))
        assert f"top 5 by {by}" in printed and "recall@100 1.000 measured at build" in printed
        got = pd.read_parquet(top)
        order = np.argsort(-everything[by].fillna(-np.inf).to_numpy(), kind="stable")[:5]
        want = everything.iloc[order].reset_index(drop=True)[list(got.columns)]
        assert [c for c in everything.columns if c in got.columns] == list(got.columns)
        assert {c for c in everything.columns if c.endswith(tuple(f"align_{a}" for a in aggregate.split(",")))} \
            <= set(got.columns)
        pd.testing.assert_frame_equal(got, want)
        meta = read_metadata(top)
        assert meta["top"]["by"] == by and meta["top"]["settings"]["kind"] == "flat" and "estimate" in meta


def test_each_query_gives_its_columns_cosines():
    """cos(x, q) for the query index_queries makes is align_mean_gradient; times |q|, align_mean (so both rank
    rows as the columns do); align_max asks with each example."""
    from gradspec.alignment.cosines import projected_cosines
    from gradspec.runs.store_query import index_queries

    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(40, 12, dtype=torch.float64, generator=generator)
    task = torch.randn(5, 12, dtype=torch.float64, generator=generator) * torch.tensor([[0.1], [1], [3], [10], [1]])
    _, whole = projected_cosines(pool, task, ["m"], ("mean_gradient", "mean"))
    unit = pool / pool.norm(dim=1, keepdim=True)
    q = torch.from_numpy(index_queries(task, "align_mean_gradient"))[0]
    torch.testing.assert_close(unit @ q / q.norm(), whole[:, 0])
    q = torch.from_numpy(index_queries(task, "align_mean"))[0]
    torch.testing.assert_close(unit @ q, whole[:, 1])
    assert torch.equal(torch.from_numpy(index_queries(task, "align_max")), task)


def _synthetic(path, rows, dims, seed=0):
    """A store of random clustered vectors (no model), one row without a vector."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((8, dims))
    x = (centres[rng.integers(0, 8, rows)] + rng.standard_normal((rows, dims))).astype(np.float32)
    values = pa.array([None if i == 3 else list(v) for i, v in enumerate(x)], pa.list_(pa.float32()))
    meta = {"parts": [], "metrics": [], "projection": {"parts": ["a", "b"], "k_in": 2, "k_out": dims // 4}}
    table = pa.table({"index": np.arange(rows), "status": ["ok"] * rows, PROJECTION: values})
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), path, row_group_size=700)
    return centres


def test_an_ivf_index_finds_the_exact_top(tmp_path, monkeypatch):
    """Past FLAT_ROWS the index is IVF over reduced vectors: its candidates re-ranked give the exact scan's top."""
    monkeypatch.setattr(store_index, "FLAT_ROWS", 100)
    monkeypatch.setattr(store_index, "REDUCED", 8)
    path = tmp_path / "s.parquet"
    centres = _synthetic(path, 3000, 16)
    header = build_index(path)
    assert header["settings"]["kind"].startswith("IVF") and header["settings"]["reduced"] == 8
    assert header["indexed"] == 2999 and header["recall"]["value"] >= 0.99
    task = torch.from_numpy(centres[2] + np.random.default_rng(1).standard_normal((6, 16)))
    reader = pq.ParquetFile(path)
    for aggregates in [("mean_gradient", "mean"), ("max",)]:
        table, info = top_rows(read_index(path), reader, kept_columns(reader), ["a", "b"], task, aggregates, set(), 20)
        exact = pa.concat_tables(scanned(reader, kept_columns(reader), ["a", "b"], task, aggregates, set()))
        by = ranked_by(aggregates)
        order = np.argsort(-np.nan_to_num(exact[by].to_numpy(zero_copy_only=False), nan=-np.inf), kind="stable")[:20]
        assert table.equals(exact.take(pa.array(order))), aggregates
        assert info["candidates"] < 3000


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "s.parquet"
    _synthetic(path, 50, 16)
    build_index(path)
    return path


def _refused(path, match):
    with pytest.raises(InputError, match=match):
        read_index(path)


def test_a_damaged_or_truncated_index_is_refused(small):
    index = index_path(small)
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 1
    index.write_bytes(bytes(data))
    _refused(small, rf"{index}: damaged, its bytes differ .*checksum mismatch.*gradspec project --out")
    data[len(data) // 2] ^= 1
    index.write_bytes(bytes(data[:-10]))
    _refused(small, rf"{index}: damaged, its bytes differ")
    index.write_bytes(bytes(data))
    read_index(small)  # whole again: read


def test_a_foreign_file_with_its_checksum_is_refused(small):
    """A checksum says the bytes are those written, not that gradspec wrote them: FAISS never sees them."""
    index = index_path(small)
    for body in [b"not an index at all", store_index.MAGIC + b"\x05\x00\x00\x00\x00\x00\x00\x00{\"a\"}"]:
        index.write_bytes(body)
        index.with_name(index.name + ".sha256").write_text(hashlib.sha256(body).hexdigest())
        _refused(small, rf"{index}: not a readable index")


def test_an_index_of_another_store_is_refused(small, tmp_path):
    other = tmp_path / "other" / "s.parquet"
    other.parent.mkdir()
    _synthetic(other, 50, 16, seed=1)
    for suffix in (".faiss", ".faiss.sha256", ".vectors"):
        shutil.copy(f"{small}{suffix}", f"{other}{suffix}")
    _refused(other, rf"{index_path(other)}: an index of another store than {other} \(.*footer_sha256")


def test_a_linked_index_is_refused(small, tmp_path):
    index = index_path(small)
    moved = tmp_path / "elsewhere.faiss"
    index.rename(moved)
    os.symlink(moved, index)
    _refused(small, rf"{index}: a symbolic link, refused")


def test_damaged_vectors_are_refused_where_read(small):
    vectors = vectors_path(small)
    data = bytearray(vectors.read_bytes())
    data[7 * 64] ^= 1  # row 7 of 16 float32 values
    vectors.write_bytes(bytes(data))
    index = read_index(small)
    with pytest.raises(InputError, match=rf"{vectors}: damaged, block 0 \(rows 0-"):
        index.rows(np.array([7]))
    vectors.write_bytes(bytes(data[:-4]))
    _refused(small, rf"{vectors}: damaged, 3196 bytes where 50 rows of 16 float32 take 3200")


def test_top_options_are_checked(store, tmp_path, capsys):
    task = str(store.parent / "task.jsonl")
    out = str(tmp_path / "o.parquet")
    assert main(["align", "--data", task, "--target", task, "--out", out, "--top", "3"]) == 2
    assert "--top needs --store" in capsys.readouterr().err
    bare = tmp_path / "bare.parquet"
    shutil.copy(store, bare)
    assert main(["align", "--store", str(bare), "--target", task, "--out", out, "--top", "3"]) == 2
    assert f"{bare}.faiss: no index beside the store; build one" in capsys.readouterr().err
    assert main(["align", "--store", str(store), "--target", task, "--out", out, "--top", "0"]) == 2
    assert "--top 0: give a number of rows of 1 or more" in capsys.readouterr().err
