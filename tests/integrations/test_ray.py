"""The Ray Data stage (gradspec.integrations.ray) on a local 2-CPU Ray cluster: its rows are gradspec score's,
bit for bit where its batches are score's chunks; a killed actor's batch is scored again, every row once; a bad
row is its row's input_error; a resumed pipeline scores only the chunks it had not written."""

from __future__ import annotations

import json
import os
import signal

import pandas as pd
import pytest

ray = pytest.importorskip("ray")

from gradspec.integrations.ray import GradspecScorer, score_dataset  # noqa: E402
from gradspec.runs.run_folder import RunFolder  # noqa: E402
from gradspec.runs.score_files import read_metadata, read_scores  # noqa: E402

CHUNK_ROWS = 4


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                                                   os.environ.get("PYTHONPATH")]))}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield
    ray.shutdown()


def _rows() -> list[dict]:
    """Ten rows in gradspec's layouts (Alpaca, chat, ShareGPT, prompt/completion), one of them malformed."""
    rows = []
    for i in range(10):
        layout = i % 4
        if layout == 0:
            rows.append({"instruction": f"Add {i} and {i}.", "output": f"The sum is {2 * i}.", "id": i})
        elif layout == 1:
            rows.append({"messages": [{"role": "user", "content": f"Name {i} colours."},
                                      {"role": "assistant", "content": "Red, green and blue." * (i % 3 + 1)}], "id": i})
        elif layout == 2:
            rows.append({"conversations": [{"from": "human", "value": f"Count to {i}."},
                                           {"from": "gpt", "value": " ".join(map(str, range(i)))}], "id": i})
        else:
            rows.append({"prompt": f"Spell {i}:", "completion": f" {i} is spelled so.", "id": i})
    rows[5] = {"instruction": "no output here", "id": 5}  # missing its response field
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()) + "{not json\n")  # row 10: malformed
    return path


@pytest.fixture(scope="module")
def reference(data, tiny_model_dir, tmp_path_factory):
    """gradspec score's file of data (bad rows skipped), scored with one thread as each actor is."""
    import torch

    import gradspec

    out = tmp_path_factory.mktemp("ray-ref") / "scores.parquet"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gradspec.score(str(data), str(tiny_model_dir), out, chunk_rows=CHUNK_ROWS, on_error="skip", progress=False,
                       classic=True)
    finally:
        torch.set_num_threads(threads)
    return read_scores(out)[0]


def test_pipeline_rows_are_score_rows_bit_for_bit_and_a_resume_scores_only_the_missing(
        cluster, data, tiny_model_dir, reference, tmp_path):
    """A run stopped with chunk 1 unwritten (its part removed), resumed: that chunk alone is scored again, and the
    merged file is gradspec score's bit for bit (the same chunks, in the same batches), bad rows included."""
    out = tmp_path / "ray.parquet"
    first = score_dataset(data, out, tiny_model_dir, chunk_rows=CHUNK_ROWS, classic=True, merge=False)
    assert sum(first.values()) == 11 and first["input_error"] == 2
    folder = RunFolder(out)
    assert folder.done() == {0, 1, 2} and not out.exists()
    folder.part(1).unlink()  # as if stopped before chunk 1 was written
    again = score_dataset(data, out, tiny_model_dir, chunk_rows=CHUNK_ROWS, classic=True, resume=True)
    assert sum(again.values()) == CHUNK_ROWS  # chunk 1 alone scored again
    got, long = read_scores(out)
    assert len(long) > 0 and read_metadata(out)["parts"]
    pd.testing.assert_frame_equal(got[reference.columns], reference)
    assert got.loc[10, "error"].startswith(f"{data}:11: malformed JSON")
    assert "missing field 'output'" in got.loc[5, "error"]
    assert not folder.path.exists()
    assert score_dataset(data, out, tiny_model_dir, chunk_rows=CHUNK_ROWS, classic=True, resume=True) == {}


def test_the_stage_reads_every_batch_format_and_gives_score_rows(cluster, tiny_model_dir, reference):
    """GradspecScorer called on Ray's three batch formats of the same rows (Arrow, pandas, NumPy: Ray's default)
    gives score's rows, bit for bit where the batch holds whole chunks (rows 0-9, chunks of 4)."""
    import torch

    rows = [{**r, "row": i} for i, r in enumerate(_rows())]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference's
    try:
        scorer = GradspecScorer(tiny_model_dir, index_column="row", chunk_rows=CHUNK_ROWS, classic=True)
        ds = ray.data.from_items(rows)
        outputs = [scorer(ds.take_batch(len(rows), batch_format=f)).to_pandas() for f in ("pyarrow", "pandas", "numpy")]
    finally:
        torch.set_num_threads(threads)
    want = reference.iloc[:10]
    for got in outputs:
        columns = [c for c in want.columns if c != "error"]  # a row is named by its index here, not its line
        pd.testing.assert_frame_equal(got[columns], want[columns])
        assert got["error"].iloc[5] == "row 5: missing field 'output'"


class _KilledOnce(GradspecScorer):
    """Kills its own process (SIGKILL, by its PID) in its second batch, the first time only (marker)."""

    def __init__(self, marker: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker, self.batches = marker, 0

    def __call__(self, batch):
        self.batches += 1
        if self.batches == 2 and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(batch)


def test_killed_actor_is_retried_and_every_row_comes_once(cluster, tiny_model_dir, reference, tmp_path):
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    rows = [{**r, "row": i} for i, r in enumerate(_rows())]
    ds = ray.data.from_items(rows, override_num_blocks=5).map_batches(
        _KilledOnce, fn_constructor_kwargs={"marker": str(tmp_path / "killed"), "model": str(tiny_model_dir),
                                            "index_column": "row", "chunk_rows": CHUNK_ROWS, "classic": True},
        batch_size=2, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1)
    got = ds.to_pandas().sort_values("index", ignore_index=True)
    assert (tmp_path / "killed").exists()  # the actor was killed, by its PID
    assert got["index"].tolist() == list(range(10))  # every row exactly once
    assert got.loc[5, "status"] == "input_error"
    ok = got["status"] != "input_error"
    want = reference.iloc[:10]
    for column in ["loss", *[c for c in reference.columns if "/" in c]]:  # other batches: the last bits may differ
        assert got.loc[ok, column].to_numpy() == pytest.approx(want.loc[ok, column].to_numpy(), rel=1e-4, nan_ok=True)
    assert got["status"].tolist() == want["status"].tolist()


def test_command_reads_a_folder_of_parquet_files_and_select_reads_its_output(cluster, tiny_model_dir, tmp_path,
                                                                             capsys):
    """gradspec ray-score on a folder of two Parquet files (rows 0-2, 3-6: chunk 1 across both), read one after
    the other; gradspec select reads what it wrote."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gradspec.cli import main

    rows = [{"instruction": f"Add {i} and {i}.", "output": f"The sum is {2 * i}.", "id": i} for i in range(7)]
    rows[4]["output"] = None  # no response: its row's input_error
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3]), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:]), folder / "b.parquet")
    (folder / "_SUCCESS").write_text("")
    out = tmp_path / "ray.parquet"
    assert main(["ray-score", "--data", str(folder), "--model", str(tiny_model_dir), "--out", str(out),
                 "--chunk-rows", "2", "--num-cpus", "2", "--quiet"]) == 0  # the whole cluster: the actor reads too
    assert f"wrote {len(rows)} rows to {out}" in capsys.readouterr().out
    wide = read_scores(out)[0]
    assert wide["index"].tolist() == list(range(len(rows)))
    assert wide.loc[4, "error"] == f"{folder / 'b.parquet'} row 1: missing field 'output'"
    assert wide.drop(index=4)["id"].tolist() == [0, 1, 2, 3, 5, 6]
    chosen = tmp_path / "chosen.jsonl"
    assert main(["select", "--scores", str(out), "--by", "nuclear_norm", "--count", "2", "--out", str(chosen)]) == 0
    assert len(chosen.read_text().splitlines()) == 2
