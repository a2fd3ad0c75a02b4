"""benchmarks/peers/peer_files.py and peer_runs.py, without the peers (CI installs neither kronfluence nor
dattri): rows read as gradspec reads them, a peer's (target, pool) table written as an attribution file that
validate reads back unchanged, with its sidecar, and the command a docs script runs for each peer."""

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a package at the root of the checkout

from benchmarks.peers import peer_runs  # noqa: E402
from benchmarks.peers.peer_files import Run, attribution_frame, read_rows, sidecar_path  # noqa: E402
from gradspec.data.templates import tokenize  # noqa: E402
from gradspec.validation.scores import read_score  # noqa: E402

ROWS = [
    {"instruction": "Add two numbers.", "output": "def add(a, b):\n    return a + b"},
    {"instruction": "Say nothing.", "output": "   "},  # no response: gradspec does not score it
    {"instruction": "Count.", "output": " ".join(str(i) for i in range(200))},  # cut at max_length
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_rows_as_gradspec(tmp_path, tokenizer):
    rows = read_rows(write_jsonl(tmp_path / "pool.jsonl", ROWS), tokenizer, max_length=32)
    assert rows.scored == [0, 2]
    assert rows.tokens[1] is None and rows.status[1] == "empty_response"
    assert rows.status[2] == "truncated" and rows.tokens[2].num_tokens == 32
    for i in rows.scored:  # gradspec's plain template: instruction, "\n", output; the output labelled
        messages = [{"role": "user", "content": ROWS[i]["instruction"]},
                    {"role": "assistant", "content": ROWS[i]["output"]}]
        expected = tokenize(messages, tokenizer, "plain", 32)
        assert (rows.tokens[i].input_ids, rows.tokens[i].labels) == (expected.input_ids, expected.labels)
    assert rows.tokens[0].num_response_tokens > 0


def test_attribution_file_reads_back_in_validate(tmp_path):
    scores = np.array([[1.5, -2.0], [0.25, 3.0]])  # (targets, scored pool rows 0 and 2)
    out = tmp_path / "peer.parquet"
    record = Run("peer", "1.0", "ekfac").write(out, attribution_frame(scores, [0, 2], 3), modules="q_proj",
                                               max_length=32, rows=3, targets=2)
    score = read_score(str(out), rows=3, targets=2)
    assert score.missing == 2  # row 1: not scored, no values
    np.testing.assert_array_equal(score.values[[0, 2]], scores.T)  # target-file order per pool row
    assert np.isnan(score.values[1]).all()
    assert json.loads(sidecar_path(out).read_text()) == record
    assert sidecar_path(out).name == "peer.parquet.json"
    assert {"tool": "peer", "version": "1.0", "method": "ekfac", "modules": "q_proj", "max_length": 32, "rows": 3,
            "targets": 2}.items() <= record.items()
    assert record["seconds"] >= 0 and record["peak_rss_mib"] > 0
    assert pd.read_parquet(out)["index"].tolist() == [0, 1, 2]


def test_attribution_frame_refuses_what_is_no_score():
    with pytest.raises(ValueError, match="2 scores are not finite .*pool row 2, target 0"):
        attribution_frame(np.array([[1.0, np.nan], [np.inf, 0.0]]), [0, 2], 3, "peer")
    with pytest.raises(ValueError, match=r"shape \(2, 2\), expected \(targets, 3 pool rows\)"):
        attribution_frame(np.ones((2, 2)), [0, 1, 2], 3)
    with pytest.raises(ValueError, match="pool row 3 is out of 0..2"):
        attribution_frame(np.ones((1, 2)), [0, 3], 3)
    with pytest.raises(ValueError, match="pool row 1 .* scored twice"):
        attribution_frame(np.ones((1, 2)), [1, 1], 3)


def fake_python(tmp_path: Path) -> Path:
    """A stand-in for a peer venv's python: records its arguments, PYTHONPATH and working folder, writes the
    --out file."""
    script = tmp_path / "python"
    script.write_text('#!/bin/sh\nprintf "%s\\n" "$PYTHONPATH" "$@" > "$(dirname "$0")/argv"\n'
                      'pwd > "$(dirname "$0")/cwd"\n'
                      'while [ $# -gt 0 ]; do [ "$1" = --out ] && touch "$2"; shift; done\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.parametrize("tool", ["kronfluence", "dattri"])
def test_peer_runs_command(tmp_path, monkeypatch, tool):
    monkeypatch.setenv(f"{tool.upper()}_PYTHON", str(fake_python(tmp_path)))
    pool, target = tmp_path / "pool.jsonl", tmp_path / "target.jsonl"
    if tool == "kronfluence":
        path = peer_runs.kronfluence(tmp_path, pool, target, 128, "--damping", "1e-8", model="M")
    else:
        path = peer_runs.dattri(tmp_path, pool, target, "logra", 128, "--proj-dim", "256", model="M")
    assert path == tmp_path / ("kronfluence_ekfac.parquet" if tool == "kronfluence" else "dattri_logra.parquet")
    assert path.exists()
    pythonpath, script, *args = (tmp_path / "argv").read_text().splitlines()
    assert pythonpath == str(ROOT) and Path(script) == ROOT / "benchmarks" / "peers" / f"{tool}_scores.py"
    assert Path(script).exists()
    # run in the peer's own folder: files a peer writes where it runs (dattri's batch_metadata.json) stay there
    assert Path((tmp_path / "cwd").read_text().strip()) == tmp_path / tool / ("ekfac" if tool == "kronfluence" else
                                                                             "logra")
    options = dict(zip(args[::2], args[1::2], strict=False))
    assert options["--model"] == "M" and options["--max-length"] == "128" and options["--out"] == str(path)
    assert options["--pool"] == str(pool) and options["--target"] == str(target)
    extra = ("--damping", "1e-8") if tool == "kronfluence" else ("--proj-dim", "256")
    assert extra[0] in options and options[extra[0]] == extra[1]
    os.remove(tmp_path / "argv")  # the file is there now: kept, not made again
    assert (peer_runs.kronfluence(tmp_path, pool, target, 128, model="M") if tool == "kronfluence"
            else peer_runs.dattri(tmp_path, pool, target, "logra", 128, model="M")) == path
    assert not (tmp_path / "argv").exists()
