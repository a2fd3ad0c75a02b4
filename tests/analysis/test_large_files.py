"""Score files too large to read whole (issue 39: a million rows of a 7B model's 1,349 columns is 11 GB):
select, report, merge and read_scores read only the columns they need, in batches of rows, check their
other inputs before any row is read, and write what they wrote when they read the file whole.

The score file here is synthetic and small (12 rows, 4 row groups) with what makes the batching matter:
parts given out of layer order, two parts of a module type in one layer (an expert beside the MLP), a part
outside the layers (lm_head, layer -1), NaN among complete rows, rows without metrics, a text and a
boolean column, and a column of singular values that nothing here needs. Each test runs with 1-row
batches (BATCH_BYTES = 1: every row group read in slices) and with the default (row groups read
together)."""

import filecmp
import json
import shutil
import subprocess
import sys
from fnmatch import fnmatchcase
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.analysis import report
from gradspec.analysis.report import per_sample, write_report
from gradspec.analysis.select import choose, criteria, write_selection
from gradspec.cli import main
from gradspec.files import parts as file_parts
from gradspec.linalg.metrics import METRICS
from gradspec.runs import score_files
from gradspec.runs.config import ScoreConfig
from gradspec.runs.run_folder import NUMERICS, RunFolder
from gradspec.runs.score_files import file_metadata, read_scores

ROWS, CHUNK = 12, 3
STATUS = ["ok", "boundary_merge", "prompt_too_long", "ok", "truncated", "ok", "ok", "empty_response", "ok", "ok",
          "ok", "boundary_merge;truncated"]
PARTS = [SimpleNamespace(name=n, role=r, d_in=d_in, d_out=d_out) for n, r, d_in, d_out in [
    ("model.layers.1.self_attn.q_proj", "q", 8, 8), ("model.layers.1.mlp.up_proj", "up", 8, 12),
    ("model.layers.1.mlp.experts.0.up_proj", "up", 8, 6), ("model.layers.0.self_attn.q_proj", "q", 8, 8),
    ("model.layers.0.self_attn.k_proj", "k", 8, 4), ("model.layers.0.mlp.up_proj", "up", 8, 12),
    ("model.layers.1.self_attn.k_proj", "k", 8, 4), ("lm_head", "head", 8, 50)]]
SPECTRA = "model.layers.0.self_attn.q_proj/singular_values"
DEFAULT_BATCH = 64 << 20  # score_files.BATCH_BYTES


def _rows() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for i, status in enumerate(STATUS):
        scored = status not in ("prompt_too_long", "empty_response")
        row = {"index": i, "status": status, "loss": float(rng.gamma(2.0)) if scored else None,
               "num_tokens": int(rng.integers(3, 40)), "num_response_tokens": int(rng.integers(1, 20)),
               "reward": float(i % 5), "note": f"row {i}", "flag": bool(i % 2)}
        for p in PARTS:
            for m in METRICS:
                row[f"{p.name}/{m}"] = float(rng.random() * 10) if scored else None
        if scored:
            row[SPECTRA] = [3.0, 2.0, 1.0]
        rows.append(row)
    rows[4]["model.layers.1.mlp.up_proj/effective_rank"] = float("nan")  # a complete row with a NaN metric
    rows[6]["lm_head/nuclear_norm"] = float("nan")
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The input and a finished run folder of it (4 parts of 3 rows), as `gradspec score --no-merge` leaves it."""
    root = tmp_path_factory.mktemp("large")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Question {i}?", "output": f"Answer {i}."}) + "\n"
                            for i in range(ROWS)))
    config = ScoreConfig(data=str(data), model="synthetic", modules="all", chunk_rows=CHUNK)
    info = json.loads(json.dumps({**config.describe(), "model_path": "synthetic", "model_fingerprint": None,
                                  NUMERICS: {}}))
    folder = RunFolder(root / "run" / "s.parquet")
    folder.start(info, resume=False, overwrite=False, records=ROWS)
    rows = _rows()
    for chunk in range(ROWS // CHUNK):
        folder.write_part(chunk, rows[chunk * CHUNK:(chunk + 1) * CHUNK], file_metadata(PARTS, METRICS, info))
    folder.release()
    return root


@pytest.fixture(scope="module")
def scores(run):
    """The run merged, a row group a part (as merge wrote it before: every read crosses row groups)."""
    out = run / "merged" / "s.parquet"
    out.parent.mkdir()
    shutil.copytree(run / "run" / "s.parquet.parts", out.parent / "s.parquet.parts")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(file_parts, "GROUP_BYTES", 1)
        assert main(["merge", "--out", str(out)]) == 0
    assert pq.ParquetFile(out).metadata.num_row_groups == ROWS // CHUNK
    return out


@pytest.fixture
def batches(monkeypatch, request):
    monkeypatch.setattr(score_files, "BATCH_BYTES", request.param, raising=False)
    monkeypatch.setattr(report, "CURVE_BYTES", request.param, raising=False)


def _reads(monkeypatch, allowed: set[str] | None = None) -> list:
    """Records the columns of every read of a Parquet file's rows (None: all of them); with allowed, a read
    of any other column fails."""
    seen = []

    def check(columns):
        seen.append(None if columns is None else tuple(columns))
        if allowed is not None and (columns is None or not set(columns) <= allowed):
            raise AssertionError(f"read {'every column' if columns is None else sorted(set(columns) - allowed)}")

    def spying(real):
        def spy(self, *args, columns=None, **kwargs):
            check(columns)
            return real(self, *args, columns=columns, **kwargs)
        return spy

    for name in ("read_row_groups", "read_row_group", "iter_batches", "read"):
        monkeypatch.setattr(pq.ParquetFile, name, spying(getattr(pq.ParquetFile, name)))
    real_read_table = pq.read_table

    def read_table(source, *args, columns=None, **kwargs):
        check(columns)
        return real_read_table(source, *args, columns=columns, **kwargs)

    monkeypatch.setattr(pq, "read_table", read_table)
    return seen


# select

@pytest.mark.parametrize("batches", [1, DEFAULT_BATCH], indirect=True, ids=["1-row", "default"])
@pytest.mark.parametrize(("by", "size"), [
    ("effective_rank", ["--count", "4"]), ("effective_rank:1,nuclear_norm:-1", ["--fraction", "0.5"]),
    ("loss", ["--count", "20", "--bottom"]), ("model.layers.0.self_attn.q_proj/stable_rank", ["--count", "3"]),
    ("reward:2,sigma1_ratio:-1", ["--count", "6", "--length-buckets", "2"])])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_select_writes_what_it_wrote_from_the_whole_file(scores, run, tmp_path, capsys, batches, by, size, suffix):
    """The command reads a batch at a time; the selection is the one made from the whole table, as before."""
    out, whole = tmp_path / f"chosen{suffix}", tmp_path / f"whole{suffix}"
    capsys.readouterr()
    assert main(["select", "--scores", str(scores), "--out", str(out), "--by", by, *size]) == 0
    printed = capsys.readouterr().out
    table = read_scores(scores)[0]  # the whole file, as select read it
    count = int(size[1]) if size[0] == "--count" else None
    fraction = float(size[1]) if size[0] == "--fraction" else None
    chosen = choose(table, by, top="--bottom" not in size, count=count, fraction=fraction,
                    length_buckets=int(size[size.index("--length-buckets") + 1]) if "--length-buckets" in size else 0)
    columns = ["gradspec_score", *dict.fromkeys(name for name, _ in criteria(by)), "loss", "num_tokens"]
    n = write_selection(run / "d.jsonl", chosen, whole, columns)
    assert filecmp.cmp(out, whole, shallow=False)
    assert printed.startswith(f"wrote {n} of {ROWS} rows to {out} (only complete rows compete; left out: "
                              "1 prompt_too_long, 1 empty_response")


@pytest.mark.parametrize(("changed", "message"), [
    ({"--data": "{tmp}/missing.jsonl"}, "{tmp}/missing.jsonl: no such file or folder (nor a Hub dataset name: "
                                        "org/name)"),
    ({"--data": "{tmp}/d.csv"}, "{tmp}/d.csv: unknown format (expected .json, .jsonl, .parquet, a datasets folder or "
                                "a Hub dataset name)"),
    ({"--out": "{tmp}/o.csv"}, "--out {tmp}/o.csv: write .jsonl, .json, .parquet, or a name without a suffix for a "
                               "datasets folder"),
    ({"--by": "rank"}, "unknown criterion 'rank': not a column, and no module has it; metrics: ['effective_rank', "
                       "'frobenius_norm', 'nuclear_norm', 'sigma1_ratio', 'singular_values', 'spectral_norm', "
                       "'stable_rank']"),
    ({"--by": "note"}, "--by note: not a numeric column; choose a metric or a numeric column"),
    ({"--by": "effective_rank:x"}, "--by 'effective_rank:x': weight 'x' of 'effective_rank' is not a number"),
    ({"--count": "0"}, "--count must be at least 1, got 0"),
    ({"--fraction": "2"}, "--fraction must be in (0, 1], got 2.0"),
    ({"--length-buckets": "-1"}, "--length-buckets must be 0 (none) or more, got -1")])
def test_select_refuses_a_wrong_input_before_it_reads_a_row(scores, run, tmp_path, capsys, monkeypatch, changed,
                                                           message):
    """A million rows take a minute to read: whatever can be checked without them is checked first."""
    (tmp_path / "d.csv").write_bytes((run / "d.jsonl").read_bytes())  # the scored input's size: only its format is off
    options = {"--out": "{tmp}/o.jsonl", "--by": "effective_rank", "--count": "1", **changed}
    if "--fraction" in changed:
        del options["--count"]
    argv = [part.format(tmp=tmp_path) for flag, value in options.items() for part in (flag, value)]
    _reads(monkeypatch, allowed=set())
    capsys.readouterr()
    assert main(["select", "--scores", str(scores), *argv]) == 2
    assert capsys.readouterr().err.strip() == "gradspec: error: " + message.format(tmp=tmp_path)


def test_select_reads_only_the_columns_it_needs(scores, tmp_path, monkeypatch):
    seen = _reads(monkeypatch)
    assert main(["select", "--scores", str(scores), "--out", str(tmp_path / "o.jsonl"), "--by",
                 "effective_rank:1,reward:1", "--count", "2"]) == 0
    wanted = {"index", "status", "loss", "num_tokens", "reward", *(f"{p.name}/effective_rank" for p in PARTS)}
    assert seen and all(columns is not None and set(columns) <= wanted for columns in seen)


# report

def _old_group(label: str, path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(wide, long) of a group as report computed them from the whole file (before issue 39)."""
    wide, long = read_scores(path)
    ok = wide.loc[score_files.complete(wide["status"]), "index"]
    long = long[long["index"].isin(ok)]
    dims = {p.name: min(p.d_in, p.d_out) for p in PARTS}
    er = long[long["metric"] == "effective_rank"].copy()
    tokens = wide.set_index("index")["num_tokens"]
    er["value"] = er["value"] / np.minimum(er["index"].map(tokens), er["name"].map(dims))
    er["metric"] = "effective_rank_fraction"
    wide, long = wide[score_files.complete(wide["status"])].copy(), pd.concat([long, er], ignore_index=True)
    for frame in (wide, long):
        frame["sample"] = label + ":" + frame["index"].astype(str)
    return wide, long


@pytest.mark.parametrize("batches", [1, DEFAULT_BATCH], indirect=True, ids=["1-row", "default"])
def test_report_computes_from_batches_what_it_computed_from_the_long_form(scores, batches):
    """Per-sample means over layers and the per-layer curves: the same pandas reductions over the same
    values. To the last bits only: the long form's groupby summed a group's values in the order its sort of
    the whole table left them (not a stable one), which no batch can know."""
    wide, samples, curves = report.load_group(report.check_group("g", scores))
    old_wide, long = _old_group("g", scores)
    pd.testing.assert_frame_equal(samples, per_sample(long), rtol=1e-14)
    for (metric, role), found in curves.items():
        by_layer = long[(long["metric"] == metric) & (long["module"] == role)].groupby("layer")["value"]
        want = pd.DataFrame({"lo": by_layer.quantile(0.25), "median": by_layer.median(), "hi": by_layer.quantile(0.75)})
        pd.testing.assert_frame_equal(found, want, rtol=1e-14, check_names=False, check_index_type=False)
    assert set(curves) == {(m, r) for m in report.CURVE_METRICS for r in ("q", "k", "up")}
    numbers = ["index", "loss", "num_tokens", "num_response_tokens", "reward", "sample"]
    pd.testing.assert_frame_equal(wide[numbers].reset_index(drop=True), old_wide[numbers].reset_index(drop=True))
    assert wide["note"].isna().all() and "flag" in wide.columns and SPECTRA not in wide.columns


def test_report_is_the_same_in_any_batches(scores, run, tmp_path, monkeypatch):
    other = run / "merged" / "other.parquet"  # a second group: another path to the same rows
    if not other.exists():
        other.hardlink_to(scores)
    groups = {"a": scores, "b": other}
    write_report(groups, tmp_path / "default")
    monkeypatch.setattr(score_files, "BATCH_BYTES", 1, raising=False)
    monkeypatch.setattr(report, "CURVE_BYTES", 1, raising=False)
    write_report(groups, tmp_path / "small")
    compared = filecmp.dircmp(tmp_path / "default", tmp_path / "small")
    assert not compared.diff_files and not compared.left_only and not compared.right_only


def test_report_checks_every_input_before_it_reads_a_module(scores, tmp_path, capsys, monkeypatch):
    """The same file twice (or another module type's) is refused on the index and status columns alone."""
    _reads(monkeypatch, allowed={"index", "status"})
    capsys.readouterr()
    assert main(["report", f"a={scores}", f"b={scores}", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == (f"gradspec: error: b={scores} is the same file as a={scores}; compare "
                                               "different score files")


def test_report_reads_only_the_columns_it_needs(scores, tmp_path, monkeypatch):
    seen = _reads(monkeypatch)
    assert main(["report", f"a={scores}", "--out", str(tmp_path / "r")]) == 0
    read = set().union(*seen)
    assert None not in seen and SPECTRA not in read and "note" not in read and "flag" not in read
    assert {f"{p.name}/{m}" for p in PARTS for m in METRICS} <= read  # every metric's mean over layers is reported


# read_scores

@pytest.mark.parametrize("batches", [1, DEFAULT_BATCH], indirect=True, ids=["1-row", "default"])
@pytest.mark.parametrize(("modules", "metrics", "columns"), [
    (["q", "model.layers.1.mlp.*"], ["effective_rank", "stable_rank"], None), ("up", None, ["loss", "note"]),
    (None, ["nuclear_norm"], []), ("lm_head", "sigma1_ratio", ["reward"])])
def test_a_filtered_read_scores_is_the_long_form_filtered(scores, monkeypatch, batches, modules, metrics, columns):
    wide, long = read_scores(scores)
    names = [modules] if isinstance(modules, str) else modules
    parts = [p for p in PARTS if names is None or any(n in (p.name, p.role) or fnmatchcase(p.name, n) for n in names)]
    kept = [metrics] if isinstance(metrics, str) else metrics or list(METRICS)
    want = long[long["name"].isin([p.name for p in parts]) & long["metric"].isin(kept)].reset_index(drop=True)
    seen = _reads(monkeypatch)
    found_wide, found = read_scores(scores, modules=modules, metrics=metrics, columns=columns)
    pd.testing.assert_frame_equal(found, want, check_exact=True)
    others = [c for c in wide.columns if "/" not in c] if columns is None else ["index", *columns]
    modules_read = [f"{p.name}/{m}" for p in parts for m in kept]
    assert set(found_wide.columns) == {*others, *modules_read}
    pd.testing.assert_frame_equal(found_wide, wide[found_wide.columns], check_exact=True)
    assert seen and set().union(*seen) == set(found_wide.columns)
    batches_read = list(score_files.iter_scores(scores, modules=modules, metrics=metrics, columns=columns))
    assert len(batches_read) == (ROWS if score_files.BATCH_BYTES == 1 else 1)
    pd.testing.assert_frame_equal(pd.concat([b for _, b in batches_read], ignore_index=True), want, check_exact=True)


def test_iter_scores_yields_read_scores_batch_by_batch(scores, monkeypatch):
    wide, long = read_scores(scores)
    monkeypatch.setattr(score_files, "BATCH_BYTES", 1, raising=False)
    parts = list(score_files.iter_scores(scores))
    assert len(parts) == ROWS
    pd.testing.assert_frame_equal(pd.concat([w for w, _ in parts], ignore_index=True), wide, check_exact=True)
    pd.testing.assert_frame_equal(pd.concat([lg for _, lg in parts], ignore_index=True), long, check_exact=True)


@pytest.mark.parametrize(("given", "message"), [
    ({"modules": ["gate"]}, "modules 'gate': no part of {scores} matches (roles: q, up, k, head; or a part's name, "
                            "or a glob of names)"),
    ({"metrics": ["rank"]}, "metrics 'rank': not a metric of {scores} (nuclear_norm, effective_rank, spectral_norm, "
                            "frobenius_norm, stable_rank, sigma1_ratio)"),
    ({"columns": ["reward", "prompt"]}, "columns 'prompt': not a column of {scores}")])
def test_a_filter_that_matches_nothing_is_refused_before_a_row_is_read(scores, monkeypatch, given, message):
    _reads(monkeypatch, allowed=set())
    with pytest.raises(ValueError) as refused:
        read_scores(scores, **given)
    assert str(refused.value) == message.format(scores=scores)


# merge

@pytest.mark.parametrize("batches", [1, DEFAULT_BATCH], indirect=True, ids=["1-row", "default"])
def test_merge_writes_the_parts_rows_in_row_groups_of_many_parts(run, tmp_path, batches):
    """Row groups of about ROW_GROUP_BYTES (here: one), not one a part: a row group's every column has its entry
    in the footer, which each reader parses whole (1.3 GB for a million rows of 1,024-row groups)."""
    out = tmp_path / "s.parquet"
    shutil.copytree(run / "run" / "s.parquet.parts", tmp_path / "s.parquet.parts")
    parts = [pq.read_table(p) for p in sorted((tmp_path / "s.parquet.parts").glob("*.parquet"))]
    assert main(["merge", "--out", str(out)]) == 0
    merged = pq.read_table(out)
    assert pq.ParquetFile(out).metadata.num_row_groups == 1
    assert merged.to_pandas().equals(pa.concat_tables(parts).to_pandas())
    described = dict(score_files.schema_metadata(parts[0].schema))
    del described["part"]
    assert score_files.schema_metadata(merged.schema) == described


def test_a_merge_loads_no_torch(run, tmp_path):
    """A merge rebuilds the run's config from its manifest (every option's check): none of them needs torch."""
    shutil.copytree(run / "run" / "s.parquet.parts", tmp_path / "s.parquet.parts")
    out = str(tmp_path / "s.parquet")
    code = (f"import sys\nfrom gradspec.cli import main\ncode = main(['merge', '--out', {out!r}])\n"
            "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "0 False", done.stdout + done.stderr


def test_validate_refuses_a_file_that_is_no_retrain_file_before_torch_loads(tmp_path):
    """validate --runs reads retrain files' numbers: a wrong file is named in about 2 s, not after torch's 4 s
    more (the retrain's modules, and the model checks, are imported only for a retrain)."""
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    code = (f"import sys\nfrom gradspec.cli import main\ncode = main(['validate', '--runs', {str(bad)!r}])\n"
            "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "2 False", done.stdout + done.stderr
    assert "not a readable Parquet file" in done.stderr


def test_the_commands_that_read_score_files_load_no_torch():
    """select, report and merge read a file's numbers: torch, 225 MB and seconds to load, stays out."""
    code = ("import sys, gradspec.cli.select, gradspec.cli.report, gradspec.cli.merge, gradspec.analysis.select, "
            "gradspec.analysis.report, gradspec.runs.run_folder; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    from gradspec.choices import METRICS as NAMED

    assert NAMED == METRICS  # the names a score file's columns carry, without torch


def test_progress_bars_say_what_is_read(scores, run, tmp_path, capsys):
    write_report({"a": scores}, tmp_path / "r", progress=True)
    read_scores(scores, metrics="effective_rank", progress=True)
    shutil.copytree(run / "run" / "s.parquet.parts", tmp_path / "s.parquet.parts")
    RunFolder(tmp_path / "s.parquet").merge(ROWS, CHUNK, progress=True)
    err = capsys.readouterr().err
    for said in ("checking a", "reading a", "layer curves a", "reading s.parquet", "checking s.parquet.parts",
                 "merging s.parquet"):
        assert said in err, said
