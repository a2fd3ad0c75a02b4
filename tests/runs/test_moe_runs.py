"""Scoring an MoE model from the command line: expert and router columns, routed-token counts, and
which experts implementation ran, recorded in the file."""

import json

import pyarrow.parquet as pq

import gradspec
from gradspec.cli import main
from gradspec.runs.score_files import read_metadata

ROWS = [{"instruction": "Write a haiku about rain.", "output": "Soft rain on the roof,\nquiet streets."},
        {"instruction": "What is 2+2?", "output": "4"},
        {"instruction": "Describe it", "input": "a cat", "output": ""}]
EXPERTS = "model.layers.1.mlp.experts"


def test_score_all_includes_experts_and_routers(tmp_path, tiny_moe_dir):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "s.parquet"
    assert main(["score", "--data", str(data), "--model", str(tiny_moe_dir), "--out", str(out), "--modules", "all",
                 "--max-length", "64", "--quiet"]) == 0
    df = pq.read_table(out).to_pandas()
    parts = {c.rsplit("/", 1)[0] for c in df.columns if c.endswith("/nuclear_norm")}
    assert len(parts) == 2 * (4 + 4 * 3 + 1)  # per layer: q, k, v, o; 4 experts x gate, up, down; the router
    assert {f"{EXPERTS}.3.gate_proj", f"{EXPERTS}.3.up_proj", f"{EXPERTS}.3.down_proj",
            "model.layers.1.mlp.gate"} <= parts
    assert df["status"].tolist() == ["ok", "ok", "empty_response"]
    routed = df[[f"{EXPERTS}.{e}/routed_tokens" for e in range(4)]]
    assert routed.loc[:1].sum(axis=1).tolist() == (2 * df.loc[:1, "num_tokens"]).tolist()  # top-2 of every token
    assert routed.loc[2].isna().all()  # not scored: nothing routed is recorded
    for e in range(4):  # an expert a sample never reached has no values, and the row is still ok
        unreached = df[f"{EXPERTS}.{e}/routed_tokens"] == 0
        assert df.loc[unreached, f"{EXPERTS}.{e}.down_proj/nuclear_norm"].isna().all()
    meta = read_metadata(out)
    assert meta["experts_implementation"] == {"captured_as": "gradspec", "model": "grouped_mm"}
    roles = {p["role"] for p in meta["parts"]}
    assert roles == {"q", "k", "v", "o", "expert_gate", "expert_up", "expert_down", "router"}


def test_presets_experts_and_router(tiny_moe_dir):
    model, _ = gradspec.data.models.load_model(str(tiny_moe_dir))
    experts = gradspec.SpectralEngine(model, "experts").parts
    assert {p.role for p in experts} == {"expert_gate", "expert_up", "expert_down"} and len(experts) == 24
    assert [p.name for p in gradspec.SpectralEngine(model, "router").parts] == [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert [p.name for p in gradspec.SpectralEngine(model, "*.1.*experts.2.down_proj").parts] == [
        f"{EXPERTS}.2.down_proj"]
    # a glob of the router's name is the router's alone: an expert's gate half is its gate_proj, as a dense MLP's
    assert [p.name for p in gradspec.SpectralEngine(model, "*.gate").parts] == [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def test_a_store_query_flags_as_the_exact_alignment_does(tmp_path, tiny_moe_dir):
    """An expert a pool sample did not reach has no cosine there (NaN), which is no fault of the row: the store's
    query leaves it ok, as the exact alignment does, and flags only what that flags."""
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps({"instruction": f"Say {i}", "output": f"{i} {i} {i}"}) + "\n" for i in range(3)))
    store, queried, exact = tmp_path / "p.parquet", tmp_path / "q.parquet", tmp_path / "a.parquet"
    model = ["--model", str(tiny_moe_dir), "--modules", "all", "--limit", "6", "--quiet"]
    assert main(["project", *model, "--k", "4", "--out", str(store)]) == 0
    assert main(["align", "--store", str(store), "--target", str(task), "--out", str(queried), "--quiet"]) == 0
    assert main(["align", *model, "--target", str(task), "--out", str(exact)]) == 0
    rows = pq.read_table(queried).to_pandas()
    unreached = [c for c in rows.columns if c.startswith(f"{EXPERTS}.") and c.endswith("/align_mean")
                 and rows[c].isna().any()]
    assert unreached  # the case under test: a sample that did not reach an expert
    assert rows["status"].tolist() == pq.read_table(exact).to_pandas()["status"].tolist() == ["ok"] * 6


def test_select_by_an_expert_s_column_says_which_rows_had_no_value(tmp_path, tiny_moe_dir, capsys):
    """A row that did not reach the expert has no value in its columns (NaN, status ok): it does not compete,
    and select says how many rows that left out instead of 'none'."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Write about {i}.", "output": "word " * (1 + i)}) + "\n"
                            for i in range(8)))
    out = tmp_path / "s.parquet"
    assert main(["score", "--data", str(data), "--model", str(tiny_moe_dir), "--out", str(out), "--modules", "experts",
                 "--quiet"]) == 0
    df = pq.read_table(out).to_pandas()
    column = next(c for c in df.columns if c.endswith("/nuclear_norm") and df[c].isna().any())
    missing = int(df[column].isna().sum())
    capsys.readouterr()
    chosen_file = tmp_path / "x.jsonl"
    assert main(["select", "--scores", str(out), "--by", column, "--count", "8", "--out", str(chosen_file)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {8 - missing} of 8 rows" in printed and f"left out: {missing} without a value of {column}" in printed
    chosen = [json.loads(line)["instruction"] for line in chosen_file.read_text().splitlines()]
    assert chosen == [f"Write about {i}." for i in range(8) if df[column].notna()[i]]
