"""The projected store: each sample's P_out^T G P_in from the captured X and D, unbiased for <G, G'>;
`gradspec project` writes it, `gradspec align --store` queries it with the task alone."""

import json

import pandas as pd
import pytest
import torch
from conftest import materialised_gradients, padded_batch, random_sequences, tiny_model

from gradspec.alignment.cosines import projected_cosines
from gradspec.alignment.projection import KroneckerProjection
from gradspec.cli import main
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.hooks import BatchLayout, Capture
from gradspec.runs.score_files import PROJECTION, read_metadata

VOCAB = 500


class _Keep(Capture):
    """Keeps every part's X and D of one batch."""

    def __init__(self, targets, lengths):
        super().__init__(targets, BatchLayout(lengths, "cpu"))
        self.captured = {}

    def on_part(self, part, captured):
        self.captured[part.name] = (part, captured.X, captured.D)


def test_projections_are_those_of_the_materialised_gradients():
    model = tiny_model("gpt2", vocab=VOCAB).double()  # Conv1D, fused q/k/v
    seqs = random_sequences([6, 19, 11], VOCAB, seed=1)
    engine = SpectralEngine(model, "all", spectra=False, project=5, seed=3)
    got = engine.score(*padded_batch(seqs)).projection
    grads = materialised_gradients(model, seqs, "all")
    want = []
    for g in grads:
        row = []
        for part in engine.projection.parts:
            p_in, p_out = engine.projection.matrices(part, "cpu", torch.float64)
            row.append((p_out.T @ g[part.name] @ p_in).flatten())
        want.append(torch.cat(row))
    assert got.dtype == torch.float32 and got.shape == (3, engine.projection.dims)
    torch.testing.assert_close(got, torch.stack(want).float(), rtol=1e-5, atol=1e-7)


def test_projected_inner_products_are_unbiased():
    """Over 400 seeds, the mean of <P_out^T G_i P_in, P_out^T G_j P_in> is within 4 standard errors
    of <G_i, G_j>, for every part and pair (norms included); a wrongly scaled projection is not."""
    model = tiny_model("llama", vocab=VOCAB).double()
    seqs = random_sequences([9, 14], VOCAB, seed=2)
    engine = SpectralEngine(model, "attn", spectra=False)
    ids, mask, labels = padded_batch(seqs)
    keep = _Keep(engine.targets, mask.sum(1))
    engine.backward_pass([keep], (ids, mask, labels))
    grads = materialised_gradients(model, seqs, "attn")
    for name, (part, X, D) in keep.captured.items():
        exact = torch.tensor([[float((gi[name] * gj[name]).sum()) for gj in grads] for gi in grads])
        samples = []
        for seed in range(400):
            projection = KroneckerProjection([part], 4, 3, seed)
            v = projection.project(part, X, D, keep.batch.mask, torch.float64)
            samples.append(v @ v.T)
        samples = torch.stack(samples)
        mean, stderr = samples.mean(0), samples.std(0) / 400 ** 0.5
        assert ((mean - exact).abs() <= 4 * stderr).all(), name
        assert ((2 * mean - exact).abs() > 4 * stderr).any(), name  # the test can tell a factor of 2


def test_project_store_and_align_store(tmp_path, tiny_model_dir, capsys):
    rows = [{"instruction": f"Add {a} and {b}.", "output": f"{a} + {b} = {a + b}"} for a, b in [(1, 2), (3, 9), (5, 5)]]
    rows.insert(1, {"instruction": "Say nothing.", "output": ""})
    pool, task = tmp_path / "pool.jsonl", tmp_path / "task.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task.write_text("".join(json.dumps(r) + "\n" for r in [{"instruction": "Sum 2 and 2.", "output": "4"},
                                                          {"instruction": "What is 7+1?", "output": "8"}]))
    store, out = tmp_path / "store.parquet", tmp_path / "aligned.parquet"
    assert main(["project", "--data", str(pool), "--model", str(tiny_model_dir), "--out", str(store), "--k", "4",
                 "--quiet", "--max-length", "64"]) == 0
    stored = pd.read_parquet(store)
    meta = read_metadata(store)
    dims = len(meta["projection"]["parts"]) * 16
    assert meta["projection"]["k_in"] == 4 and meta["project"] == 4 and meta["metrics"] == []
    assert stored[PROJECTION].map(lambda v: v is None).tolist() == [False, True, False, False]
    assert all(len(v) == dims for v in stored[PROJECTION].dropna())
    assert main(["align", "--store", str(store), "--target", str(task), "--out", str(out), "--aggregate",
                 "mean_gradient,mean,max"]) == 0
    aligned = pd.read_parquet(out)
    assert aligned["index"].tolist() == [0, 1, 2, 3] and aligned["status"].tolist() == stored["status"].tolist()
    assert "estimate" in read_metadata(out) and PROJECTION not in aligned.columns
    # the same cosines from the stored vectors and the task's, computed here
    model_dir = str(tiny_model_dir)
    from gradspec.runs.store_query import store_engine, task_vectors
    from gradspec.runs.task_set import task_batches

    engine, tokenizer = store_engine(meta, store, "cpu", False)
    vectors = task_vectors(engine, task_batches(task, tokenizer, max_length=64))
    pool_values = torch.tensor([list(v) if v is not None else [float("nan")] * dims for v in stored[PROJECTION]],
                               dtype=torch.float64)
    per_part, whole = projected_cosines(pool_values, vectors, meta["projection"]["parts"],
                                        ("mean_gradient", "mean", "max"))
    got = torch.tensor(aligned[["align_mean_gradient", "align_mean", "align_max"]].to_numpy(), dtype=torch.float64)
    torch.testing.assert_close(got, whole, equal_nan=True)
    assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2, 3]]).any()
    assert main(["align", "--store", str(store), "--target", str(task), "--out", str(out), "--data", str(pool)]) == 2
    assert "--data has no effect with --store" in capsys.readouterr().err
    plain = tmp_path / "plain.parquet"
    assert main(["score", "--data", str(pool), "--model", model_dir, "--out", str(plain), "--quiet",
                 "--max-length", "64"]) == 0
    assert main(["align", "--store", str(plain), "--target", str(task), "--out", str(tmp_path / "x.parquet")]) == 2
    assert "no projected gradients" in capsys.readouterr().err


@pytest.mark.parametrize("k", [0, -1])
def test_projection_sizes_must_be_positive(k):
    with pytest.raises(ValueError, match="projection sizes"):
        KroneckerProjection([], k, 4)


def test_projected_cosines_are_those_of_the_vectors():
    """Per block and over the whole vector, against an explicit loop."""
    g = torch.Generator().manual_seed(0)
    pool, task = torch.randn(5, 12, generator=g, dtype=torch.float64), torch.randn(3, 12, generator=g,
                                                                                   dtype=torch.float64)
    pool[4] = 0  # a zero gradient: undefined
    per_part, whole = projected_cosines(pool, task, ["a", "b", "c"], ("mean_gradient", "mean", "max"))

    def three(u, vs):
        cos = [float(u @ v / (u.norm() * v.norm())) for v in vs]
        mean = sum(vs) / len(vs)
        return [float(u @ mean / (u.norm() * mean.norm())), sum(cos) / len(cos), max(cos)]

    for k, name in enumerate("abc"):
        want = torch.tensor([three(u[4 * k : 4 * k + 4], [v[4 * k : 4 * k + 4] for v in task]) for u in pool[:4]],
                            dtype=torch.float64)
        torch.testing.assert_close(per_part[name][:4], want)
    torch.testing.assert_close(whole[:4], torch.tensor([three(u, list(task)) for u in pool[:4]], dtype=torch.float64))
    assert torch.isnan(whole[4]).all() and all(torch.isnan(v[4]).all() for v in per_part.values())


def test_a_leading_block_is_the_projection_by_the_leading_columns():
    from gradspec.alignment.projection import leading_block

    model = tiny_model("llama", vocab=VOCAB).double()
    seqs = random_sequences([6, 11], VOCAB, seed=4)
    engine = SpectralEngine(model, "attn", spectra=False, project=6, seed=1)
    big = engine.score(*padded_batch(seqs)).projection.double()
    small = leading_block(big, len(engine.parts), 6, 3)
    grads = materialised_gradients(model, seqs, "attn")
    for part_index, part in enumerate(engine.parts):
        p_in, p_out = engine.projection.matrices(part, "cpu", torch.float64)
        scale = (6 / 3) ** 0.5  # leading columns of N(0, 1/6) entries, as N(0, 1/3)
        for i, g in enumerate(grads):
            want = ((p_out[:, :3] * scale).T @ g[part.name] @ (p_in[:, :3] * scale)).flatten()
            got = small[i, part_index * 9 : (part_index + 1) * 9]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
