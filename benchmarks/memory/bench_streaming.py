"""Streaming: peak RSS of `gradspec score` reading a 1,000,000-row JSONL against a 10,000-row one.

Both runs read every row of their file and score the same 2,000 rows (two 1,000-row chunks, via
--shard: 0/500 of 1,000 chunks, 0/5 of 10), with a tiny random Llama. Flat memory means the two
peaks agree; the ratio prints at the end. Run with ``pytest benchmarks/memory/bench_streaming.py -s``.
"""

import json
import subprocess
import sys

import pytest

from benchmarks.common import MEDIANS, peak_rss_in, with_peak_rss

SIZES = {1_000_000: "0/500", 10_000: "0/5"}  # rows in the file: the shard that scores 2 chunks of it


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from gradspec.data.models import default_model_path

    path = tmp_path_factory.mktemp("tiny")
    config = LlamaConfig(vocab_size=49152, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         hidden_size=64, intermediate_size=80)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(path)
    return path


def _jsonl(path, rows: int):
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"instruction": f"Question {i}: what is {i} plus one?", "output": f"It is {i + 1}.",
                                "id": i}) + "\n")
    return path


@pytest.mark.parametrize("rows", list(SIZES))
def test_peak_rss(rows, tiny_model, tmp_path, benchmark):
    data = _jsonl(tmp_path / "d.jsonl", rows)
    args = ["score", "--model", str(tiny_model), "--data", str(data), "--out", str(tmp_path / "s.parquet"),
            "--shard", SIZES[rows], "--chunk-rows", "1000", "--quiet"]

    def run():
        done = subprocess.run(with_peak_rss([sys.executable, "-m", "gradspec", *args]), capture_output=True,
                              text=True, check=True)
        assert "wrote 2000 rows" in done.stdout
        return peak_rss_in(done.stderr)

    MEDIANS[f"rss-{rows}"] = benchmark.pedantic(run, rounds=1, iterations=1)
    MEDIANS[f"file-{rows}"] = data.stat().st_size / 2**20


def test_report():
    if not {f"rss-{n}" for n in SIZES} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    for n in SIZES:
        print(f"\n{n:>9,} rows ({MEDIANS[f'file-{n}']:.0f} MiB): peak RSS {MEDIANS[f'rss-{n}']:.0f} MiB")
    print(f"ratio 1M / 10k: {MEDIANS['rss-1000000'] / MEDIANS['rss-10000']:.3f}")
