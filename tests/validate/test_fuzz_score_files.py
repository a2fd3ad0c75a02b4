"""Random score files through what validate (--scores FILE[:COLUMN], --runs), select (--scores) and report
read: random bytes, truncated or garbled Parquet, JSONL where Parquet goes, columns of the wrong type
(text, lists, nulls, booleans), NaN and inf, a missing, duplicated or out-of-range index, no rows.
Nothing escapes but gradspec's own one-line InputError or OptionError (issue 49), and a NaN or inf
score that is read is counted, not used. Seeded and of a fixed size: the same cases every time, in a
few seconds; the command line itself is run for a few of them."""

import json
import random

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.analysis.report import check_group, load_group, write_report
from gradspec.analysis.select import check_criteria, choose, read_criteria
from gradspec.choices import METRICS
from gradspec.cli import main
from gradspec.errors import InputError
from gradspec.options import OptionError
from gradspec.runs.score_files import METADATA_KEY, complete, parquet_schema, read_metadata
from gradspec.validation.config import ValidateConfig
from gradspec.validation.report import analyse
from gradspec.validation.run import outcome_scores
from gradspec.validation.scores import read_score

ROWS, TARGETS = 8, 3  # the pool the retrains drew from, and the target examples they measured
CASES = 120
CLI_CASES = {"validate": 12, "select": 12, "report": 4}  # report's figures take a second a file read whole
MODULES = [f"model.layers.{layer}.self_attn.q_proj" for layer in range(2)]
SPECS = [None, "my_score", "effective_rank", "my_score:1,loss:-1"]  # validate's columns (None: the attribution)
BY = ["my_score", "effective_rank", "loss:1,my_score:-1"]  # select's criteria


def _with_metadata(table: pa.Table, meta: dict) -> pa.Table:
    return table.replace_schema_metadata({**(table.schema.metadata or {}), METADATA_KEY: json.dumps(meta).encode()})


def _score_table(rng: np.random.Generator, data: str) -> pa.Table:
    """A score file as gradspec score writes it, small: its base columns, a per-sample score, the spectral
    metrics of two modules, an attribution against TARGETS targets, and the run's modules in its metadata."""
    columns = {"index": pa.array(range(ROWS), pa.int64()), "status": ["ok"] * (ROWS - 1) + ["prompt_too_long"],
               "error": [None] * ROWS, "loss": rng.uniform(1, 3, ROWS), "num_tokens": rng.integers(5, 40, ROWS),
               "num_response_tokens": rng.integers(2, 20, ROWS), "my_score": rng.normal(size=ROWS),
               "attribution": [list(rng.normal(size=TARGETS)) for _ in range(ROWS)]}
    for name in MODULES:
        for metric in METRICS:
            columns[f"{name}/{metric}"] = rng.uniform(1, 5, ROWS)
    parts = [{"name": name, "role": "q", "layer": layer, "d_in": 64, "d_out": 64} for layer, name in enumerate(MODULES)]
    return _with_metadata(pa.table(columns), {"parts": parts, "metrics": list(METRICS), "data": data})


def _retrain_table(rng: np.random.Generator) -> pa.Table:
    """A retrain file as validate --out writes it: 4 LDS subsets of the pool, then random's and a score's
    selection (the outcome), each with its target losses and a metric."""
    members = [sorted(rng.choice(ROWS, ROWS // 2, replace=False).tolist()) for _ in range(6)]
    table = pa.table({"index": range(6), "kind": ["lds"] * 4 + ["outcome"] * 2, "subset": [0, 1, 2, 3, None, None],
                      "selection": [None] * 4 + ["random", "s:my_score"], "buckets": [0] * 6, "seed": [0] * 6,
                      "fraction": [0.5] * 6, "members": members,
                      "target_loss": [list(rng.uniform(1, 3, TARGETS)) for _ in range(6)],
                      "metric": rng.uniform(0, 1, 6)})
    return _with_metadata(table, {"rows": ROWS, "targets": TARGETS, "target": "task.jsonl"})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The valid files every case is made from, written once: a score file, the data it scored, a retrain file."""
    folder = tmp_path_factory.mktemp("fuzz-scores")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(ROWS)))
    rng = np.random.default_rng(0)
    scores, retrains = _score_table(rng, str(data)), _retrain_table(rng)
    pq.write_table(scores, folder / "scores.parquet")
    pq.write_table(retrains, folder / "retrains.parquet")
    return folder, scores, retrains


# Values of the wrong kind for a column: (arrow type or None: inferred, a value)
WRONG = [(pa.string(), "abc"), (pa.string(), None), (pa.list_(pa.float64()), [1.0, 2.0]), (pa.bool_(), True),
         (pa.float64(), float("nan")), (pa.float64(), float("inf")), (pa.float64(), -float("inf")),
         (pa.int64(), -1), (pa.int64(), 2**62), (pa.null(), None), (pa.list_(pa.string()), ["x", "y", "z"]),
         (pa.list_(pa.float64()), [float("nan")] * TARGETS), (pa.list_(pa.float64()), None),
         (pa.struct([("a", pa.int64())]), {"a": 1}), (pa.float64(), 0.5)]


def _cell(rng: random.Random, table: pa.Table, name: str) -> pa.Table:
    """table with column name holding, in some rows or all, a value of another kind."""
    arrow_type, value = rng.choice(WRONG)
    old = table.column(name).to_pylist()
    if rng.random() < 0.5 or not old:
        new = [value] * len(old)
    else:
        new = list(old)
        for _ in range(rng.randrange(1, 3)):
            new[rng.randrange(len(new))] = value
        try:
            return table.set_column(table.schema.get_field_index(name), name, pa.array(new, table.column(name).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            new = [value] * len(old)
    return table.set_column(table.schema.get_field_index(name), name, pa.array(new, arrow_type))


def _index(rng: random.Random, table: pa.Table) -> pa.Table:
    """table with its index column gone, duplicated, out of range, negative, null, or of another type."""
    at = table.schema.get_field_index("index")
    index = table.column("index").to_pylist()
    kind = rng.randrange(6) if index and pa.types.is_integer(table.column("index").type) else rng.choice([0, 5])
    if kind == 0:
        return table.remove_column(at)
    if kind == 1 and len(index) > 1:
        index[rng.randrange(1, len(index))] = index[0]
    elif kind == 2:
        index[rng.randrange(len(index))] = ROWS + rng.randrange(3)
    elif kind == 3:
        index[rng.randrange(len(index))] = -1
    elif kind == 4:
        index[rng.randrange(len(index))] = None
    else:
        return _cell(rng, table, "index")
    return table.set_column(at, "index", pa.array(index, pa.int64()))


def _table_case(rng: random.Random, table: pa.Table) -> pa.Table:
    """A valid table made wrong in one to three ways: a column's values, the index, no rows, a column gone."""
    for _ in range(rng.randrange(1, 4)):
        kind = rng.randrange(5)
        if kind < 2:
            table = _cell(rng, table, rng.choice(table.column_names))
        elif kind == 2 and "index" in table.column_names:
            table = _index(rng, table)
        elif kind == 3:
            table = table.slice(0, rng.randrange(table.num_rows + 1))
        elif table.num_columns > 1:
            table = table.remove_column(rng.randrange(table.num_columns))
    return table


def _garbled(rng: random.Random, data: bytes) -> bytes:
    """data cut short, with a few bytes changed, random bytes instead, or nothing."""
    kind = rng.randrange(4)
    if kind == 0:
        return data[: rng.randrange(len(data))]
    if kind == 1:
        out = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == 2:
        return rng.randbytes(rng.randrange(1, 300))
    return b""


def _jsonl(rng: random.Random, table: pa.Table) -> bytes:
    """The table's rows as JSONL (what a user might pass as a score file), sometimes cut short."""
    text = "".join(json.dumps(row, default=str) + "\n" for row in table.slice(0, 3).to_pylist()).encode()
    return text[: rng.randrange(len(text) + 1)] if rng.random() < 0.3 else text


def _case(rng: random.Random, path, table: pa.Table) -> None:
    """One case's file at path, from a valid table: changed and written, or its bytes garbled, or JSONL."""
    kind = rng.randrange(10)
    if kind < 6:
        pq.write_table(_table_case(rng, table), path)
    elif kind < 9:
        pq.write_table(table, path)
        path.write_bytes(_garbled(rng, path.read_bytes()))
    else:
        path.write_bytes(_jsonl(rng, table))


def _one_line(error: Exception) -> str:
    assert isinstance(error, (InputError, OptionError)), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message and "\n" not in message, message
    return message


def _finite(path, name: str) -> int:
    """How many rows of the file at path hold a finite value in column name (an independent count)."""
    return int(np.isfinite(pq.read_table(path, columns=[name]).column(0).to_pandas().astype(float)).sum())


def _validate(path, retrains) -> tuple[list[str], int, int]:
    """Every way validate reads a score file (each column spec), and a retrain file: the errors met, how
    many reads succeeded, and how many of the scores read had values missing (NaN, inf or a row unscored),
    each counted."""
    errors, done, flagged = [], 0, 0
    for spec in SPECS:
        try:
            score = read_score(str(path) if spec is None else f"{path}:{spec}", ROWS, TARGETS)
        except Exception as e:  # noqa: BLE001 - the assertion names it
            errors.append(_one_line(e))
            continue
        assert score.values.shape == (ROWS, TARGETS if spec is None else 1)
        assert not np.isinf(score.values).any(), "an inf score is used as a value"
        assert score.missing == int(np.isnan(score.values).sum())
        if spec == "my_score":
            assert score.missing == ROWS - _finite(path, "my_score"), "a NaN or inf score is not counted as missing"
        done, flagged = done + 1, flagged + (score.missing > 0)
    try:
        analyse([str(retrains)], [], resamples=10)
        done += 1
    except Exception as e:  # noqa: BLE001
        errors.append(_one_line(e))
    return errors, done, flagged


def _select(path) -> tuple[list[str], int, int]:
    """select's reads of a score file for each criterion, and its choice: the errors met, how many choices
    were made, and how many left complete rows out for want of a finite value (the count it prints)."""
    errors, done, flagged = [], 0, 0
    for by in BY:
        try:
            read_metadata(path)
            check_criteria(parquet_schema(path, "pass a score file"), by)
            scores = read_criteria(path, by)
            chosen = choose(scores, by, count=3)
        except Exception as e:  # noqa: BLE001
            errors.append(_one_line(e))
            continue
        assert np.isfinite(chosen["gradspec_score"]).all(), "a row without a finite score was chosen"
        assert chosen["index"].is_unique
        if by == "my_score":
            competes = complete(scores["status"]).to_numpy(dtype=bool)
            values = pq.read_table(path, columns=["my_score"]).column(0).to_pandas().astype(float).to_numpy()
            assert chosen.attrs["valued"] == int(np.isfinite(values[competes]).sum())
        done, flagged = done + 1, flagged + (chosen.attrs["valued"] < int(complete(scores["status"]).sum()))
    return errors, done, flagged


def _report(path) -> tuple[list[str], int, int]:
    """report's check and read of a score file as a group: the errors met, whether it was read, and whether
    it counted complete rows with a NaN or inf metric."""
    try:
        group = check_group("a", path)
        load_group(group)
    except Exception as e:  # noqa: BLE001
        return [_one_line(e)], 0, 0
    frame = pq.read_table(path).to_pandas()
    metrics = frame[[f"{name}/{metric}" for name in MODULES for metric in METRICS]].astype(float)
    lacking = ~np.isfinite(metrics[complete(frame["status"]).to_numpy(dtype=bool)])
    assert group.lacking == int(lacking.any(axis=1).sum()), "a NaN or inf metric is not counted"
    return [], 1, int(group.lacking > 0)


READ = {"validate": _validate, "select": _select, "report": _report}
# What each command's cases must have met, so that the generators keep reaching them
MET = {"validate": ["not a readable Parquet file (Parquet magic bytes", "no index column", "is given twice",
                    "has no index",
                    "not a row of the 8-row pool", "its index holds", "its attribution column holds",
                    "not a numeric column", "pass validate's --out"],
       "select": ["not a readable Parquet file (Parquet magic bytes", "no index column", "is given twice",
                  "not its flags as text", "not a numeric column"],
       "report": ["not a readable Parquet file (Parquet magic bytes", "no index column", "is given twice",
                  "not its flags as text", "not numbers", "is missing"]}


def _cases(rng: random.Random, folder, scores: pa.Table, retrains: pa.Table, count: int):
    """count cases: each a score file (and for validate's, a retrain file beside it)."""
    for case in range(count):
        path, runs = folder / f"{case}.parquet", folder / f"{case}.runs.parquet"
        _case(rng, path, scores)
        _case(rng, runs, retrains)
        yield path, runs


@pytest.mark.parametrize("command", ["validate", "select", "report"])
def test_random_score_files_meet_only_one_line_errors(base, tmp_path, command):
    _, scores, retrains = base
    errors, read, flagged = [], 0, 0
    for path, runs in _cases(random.Random(f"gradspec-fuzz-scores-{command}"), tmp_path, scores, retrains, CASES):
        found, done, counted = _validate(path, runs) if command == "validate" else READ[command](path)
        errors, read, flagged = errors + found, read + done, flagged + counted
    assert read > CASES // 5 and flagged > 0  # files got through, some with values missing that were counted
    assert all(any(kind in e for e in errors) for kind in MET[command]), MET[command]


def _argv(command: str, path, runs, out) -> list[str]:
    if command == "validate":
        return ["validate", "--runs", str(runs), "--scores", f"{path}:my_score", str(path), "--resamples", "10"]
    if command == "select":
        return ["select", "--scores", str(path), "--out", str(out / "chosen.jsonl"), "--by", "my_score", "--count",
                "3", "--overwrite", "--quiet"]
    return ["report", f"a={path}", "--out", str(out / "report"), "--overwrite", "--quiet"]


@pytest.mark.parametrize("command", ["validate", "select", "report"])
def test_random_score_files_on_the_command_line_exit_2_with_one_line(base, tmp_path, capsys, command):
    """A few of the cases through the command itself: done (0), or one line 'gradspec: error: ...' (2)."""
    _, scores, retrains = base
    codes = []
    rng = random.Random(f"gradspec-fuzz-scores-cli-{command}")
    for path, runs in _cases(rng, tmp_path, scores, retrains, CLI_CASES[command]):
        codes.append(main(_argv(command, path, runs, tmp_path)))
        err = capsys.readouterr().err
        if codes[-1] == 2:
            assert err.startswith("gradspec: error: ") and err.count("\n") == 1, err
        else:
            assert codes[-1] == 0 and "Traceback" not in err, err
    assert 2 in codes


# --- what each command does with a NaN or inf score it accepts: it says so --------------------------------------


def _with_values(table: pa.Table, name: str, values: dict[int, float]) -> pa.Table:
    column = table.column(name).to_pylist()
    for row, value in values.items():
        column[row] = value
    return table.set_column(table.schema.get_field_index(name), name, pa.array(column, pa.float64()))


def test_validate_counts_nan_and_inf_scores_as_missing(base, tmp_path, capsys, caplog):
    folder, scores, retrains = base
    path = tmp_path / "s.parquet"
    pq.write_table(_with_values(scores, "my_score", {1: float("nan"), 2: float("inf")}), path)
    score = read_score(f"{path}:my_score", ROWS, TARGETS)
    assert score.missing == 2 and np.isnan(score.values[[1, 2], 0]).all()
    assert main(["validate", "--runs", str(folder / "retrains.parquet"), "--scores", f"{path}:my_score",
                 "--resamples", "10"]) == 0
    assert "  s:my_score: " in (printed := capsys.readouterr().out) and "2 values missing, counted as 0" in printed
    config = ValidateConfig(data=str(folder / "data.jsonl"), target="task.jsonl", outcome=(f"{path}:my_score",))
    outcome_scores(config, ROWS, TARGETS)
    assert f"{path}:my_score: 2 of 8 rows have no value (NaN, inf, or not in the file); the selections take them " \
        "last" in caplog.text


def test_select_counts_an_inf_score_as_without_a_value(base, tmp_path, capsys):
    """inf is no value, as NaN: the row is left out and counted, and the other rows' z-scores stay numbers."""
    folder, scores, _ = base
    path = tmp_path / "s.parquet"
    pq.write_table(_with_values(scores, "my_score", {2: float("inf")}), path)
    assert main(["select", "--scores", str(path), "--out", str(tmp_path / "o.jsonl"), "--by", "my_score:1,loss:-1",
                 "--count", "2", "--quiet"]) == 0
    assert "left out: 1 prompt_too_long, 1 without a value of my_score:1,loss:-1)" in capsys.readouterr().out
    assert "q2" not in pd.read_json(tmp_path / "o.jsonl", lines=True)["instruction"].tolist()


def test_report_says_how_many_scored_rows_have_a_metric_without_a_value(base, tmp_path):
    folder, scores, _ = base
    paths = {"a": tmp_path / "a.parquet", "b": tmp_path / "b.parquet"}
    pq.write_table(scores, paths["a"])
    first = f"{MODULES[0]}/effective_rank"
    pq.write_table(_with_values(_with_values(scores, first, {0: float("nan"), 3: float("inf")}),
                                f"{MODULES[1]}/nuclear_norm", {3: float("nan")}), paths["b"])
    text = write_report(paths, tmp_path / "report").read_text()
    assert "**Missing values:** scored rows with a metric of some module NaN or inf: b (2 of 7); each such value " \
        "is left out of the means" in text
    summary = text.split("## Summary")[1].split("## Correlations")[0]
    assert "| inf" not in summary and "nan" not in summary  # no mean made of an inf
