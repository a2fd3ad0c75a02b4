"""Large runs: parts, resume after kill -9, sharding, torchrun, and determinism (each of them
reproduces one uninterrupted run).

Every run here is a real `gradspec score` process; outputs are compared with an uninterrupted
single-process run, table for table (values, schema and metadata), not within a tolerance.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pyarrow.parquet as pq
import pytest

from gradspec.cli import main
from gradspec.runs.score_files import read_metadata

ROWS = 60  # input rows
CHUNK = "6"  # rows per part: 10 parts
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}  # as torchrun sets per worker
# Runs the CLI after an optional patch, e.g. one that kills the process while it writes a part.
LAUNCH = "import sys; {patch}\nfrom gradspec.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "d.jsonl"
    rows = [{"instruction": f"Question {i}: " + "why " * (i % 7), "output": "Because " + "so " * (1 + i % 11),
             "id": i} for i in range(ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(model, data, out, *extra):
    return ["score", "--model", str(model), "--data", str(data), "--out", str(out), "--chunk-rows", CHUNK,
            "--batch-tokens", "256", "--quiet", *extra]


def _cli(args, patch="", **kwargs):
    return subprocess.Popen([sys.executable, "-c", LAUNCH.format(patch=patch), *args], env=ONE_THREAD,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _torchrun(*program: str, **kwargs) -> subprocess.Popen:
    """2 processes under torchrun running program (a script and its arguments, or -m gradspec ...)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             *program], env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, data):
    """The uninterrupted single-process run everything else must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "s.parquet"
    _finish(_cli(_args(tiny_model_dir, data, out)))
    return pq.read_table(out)


def _same(path, reference):
    got = pq.read_table(path)
    assert got.column("index").to_pylist() == list(range(ROWS))
    assert got.equals(reference, check_metadata=True)


def test_resume_after_kill_9_at_a_random_moment(tmp_path, tiny_model_dir, data, reference):
    out = tmp_path / "s.parquet"
    parts = tmp_path / "s.parquet.parts"
    proc = _cli(_args(tiny_model_dir, data, out))
    while len(list(parts.glob("*.parquet"))) < 3 and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and 3 <= len(list(parts.glob("*.parquet"))) < 10
    _finish(_cli(_args(tiny_model_dir, data, out, "--resume")))
    _same(out, reference)  # every other way of running (shards, torchrun, resumes) gives the reference bit for bit
    assert not parts.exists()  # parts are removed once merged


@pytest.mark.parametrize("when", ["before the rename", "half-way through the file"])
def test_resume_after_kill_while_writing_a_part(tmp_path, tiny_model_dir, data, reference, when):
    """The process dies inside the write of part 3: its temporary file is left behind, never
    taken for a part, and the resumed run scores chunk 3 again."""
    if when == "before the rename":
        patch = ("import os, signal; real = os.replace\n"
                 "def replace(src, dst):\n"
                 "    if str(dst).endswith('00000003.parquet'): os.kill(os.getpid(), signal.SIGKILL)\n"
                 "    real(src, dst)\n"
                 "os.replace = replace")
    else:
        patch = ("import os, signal, pyarrow.parquet as pq; real = pq.write_table\n"
                 "def write_table(table, f):\n"
                 "    if 'index' in table.column_names and table['index'][0].as_py() == 18:\n"
                 "        f.write(b'PAR1' + b'x' * 100); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
                 "    real(table, f)\n"
                 "pq.write_table = write_table")
    out = tmp_path / "s.parquet"
    proc = _cli(_args(tiny_model_dir, data, out), patch=patch)
    proc.wait(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    parts = tmp_path / "s.parquet.parts"
    assert sorted(p.name for p in parts.glob("*.parquet")) == [f"{c:08d}.parquet" for c in range(3)]
    assert list(parts.glob("00000003.parquet.tmp*"))
    _finish(_cli(_args(tiny_model_dir, data, out, "--resume")))
    _same(out, reference)


def test_unfinished_run_needs_resume_and_the_same_config(tmp_path, tiny_model_dir, data, capsys):
    out = tmp_path / "s.parquet"
    parts = tmp_path / "s.parquet.parts"
    assert main(_args(tiny_model_dir, data, out, "--shard", "0/2")) == 0  # half the chunks: unfinished
    assert not out.exists() and len(list(parts.glob("*.parquet"))) == 5
    assert main(_args(tiny_model_dir, data, out)) == 2
    assert "holds an unfinished run (5 parts done); pass --resume" in capsys.readouterr().err
    assert main(_args(tiny_model_dir, data, out, "--resume", "--max-length", "64", "--modules", "mlp")) == 2
    err = capsys.readouterr().err
    assert "config differs: --max-length: 2048 in the run, 64 now; --modules: 'attn' in the run, 'mlp' now" in err
    assert main(["merge", "--out", str(out)]) == 2
    assert "5 chunks not scored yet (1, 3, 5, 7, 9)" in capsys.readouterr().err
    assert main(_args(tiny_model_dir, data, out, "--shard", "1/3")) == 2  # would score chunks 1, 4, 7: a mix
    assert "holds a run split into 2 shards, and this is one of 3: pass --shard i/2 as its other shards did, or " \
           "--resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_args(tiny_model_dir, data, out, "--shard", "-1/2"))
    assert "--shard '-1/2': expected i/N with 0 <= i < N, e.g. 0/8" in capsys.readouterr().err
    assert main(_args(tiny_model_dir, data, out, "--shard", "1/2")) == 0  # the other half: now complete
    assert main(["merge", "--out", str(out)]) == 0


def test_shards_then_merge_equal_one_run(tmp_path, tiny_model_dir, data, reference, capsys):
    out = tmp_path / "s.parquet"
    shards = [_cli(_args(tiny_model_dir, data, out, "--shard", f"{i}/3")) for i in range(3)]
    printed = [_finish(p) for p in shards]
    assert all("when all are done: gradspec merge" in p for p in printed) and not out.exists()
    assert main(["merge", "--out", str(out)]) == 0
    assert f"wrote {ROWS} rows" in capsys.readouterr().out
    _same(out, reference)


# Rank 1 says what it wrote only once rank 0 has merged (a busy machine's order: it said the merged file's rows)
RANK_1_LATE = ("import os, sys, time\nimport gradspec.runs.scoring as scoring\nrun = scoring.run\n"
               "def late(config, out, **kw):\n    statuses = run(config, out, **kw)\n"
               "    while os.environ['RANK'] == '1' and not os.path.exists(out):\n        time.sleep(0.05)\n"
               "    return statuses\n"
               "scoring.run = late\nfrom gradspec.cli import main; sys.exit(main(sys.argv[1:]))\n")


def test_torchrun_two_processes_equal_one_run(tmp_path, tiny_model_dir, data, reference):
    out, launch = tmp_path / "s.parquet", tmp_path / "launch.py"
    launch.write_text(RANK_1_LATE)
    printed = _finish(_torchrun(str(launch), *_args(tiny_model_dir, data, out)))
    # rank 1 scored half into the parts; rank 0 its half, then merged the file and says what it holds
    assert printed.count(f"wrote 30 rows to {out}.parts") == 1 and printed.count(f"wrote 60 rows to {out}:") == 1
    assert f"rank 0 merges them into {out}" in printed
    _same(out, reference)


def test_torchrun_fsdp_resumes_a_run_with_two_processes_equal_to_one(tmp_path, tiny_model_dir, data):
    """--fsdp: the weights sharded across 2 gloo processes, read by rank 0 alone (the others build the
    model on the meta device and receive their shards). It resumes a run whose chunks 0, 4 and 8 are
    done (--shard 0/4): rank 0 scores chunks 2 and 6, rank 1 chunks 1, 3, 5 and 7, so rank 0 runs idle
    passes while rank 1 finishes. Every row once, equal to one process's to summation order, the
    sharding in the parts' metadata."""
    out = tmp_path / "s.parquet"
    _finish(_cli(_args(tiny_model_dir, data, out, "--chunk-rows", "7", "--shard", "0/4")))
    launch = tmp_path / "launch.py"  # the CLI, noting which ranks read weights from disk
    launch.write_text(
        "import os, sys, transformers\n"
        "read = transformers.AutoModelForCausalLM.from_pretrained.__func__\n"
        "def from_pretrained(cls, *args, **kwargs):\n"
        f"    open({str(tmp_path)!r} + '/read-by-' + os.environ['RANK'], 'w').close()\n"
        "    return read(cls, *args, **kwargs)\n"
        "transformers.AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)\n"
        "from gradspec.cli import main; sys.exit(main(sys.argv[1:]))\n")
    printed = _finish(_torchrun(str(launch), *_args(tiny_model_dir, data, out, "--fsdp", "--chunk-rows", "7",
                                                    "--resume", "--no-merge")))
    assert "wrote 14 rows" in printed and "wrote 28 rows" in printed
    assert sorted(p.name for p in tmp_path.glob("read-by-*")) == ["read-by-0"]
    sharding = read_metadata(tmp_path / "s.parquet.parts" / "00000001.parquet")["sharding"]
    assert main(["merge", "--out", str(out)]) == 0
    alone = tmp_path / "alone.parquet"  # the same chunks, so the same batches (fp32 weights: batch mates matter)
    _finish(_cli(_args(tiny_model_dir, data, alone, "--chunk-rows", "7")))
    got, want = pq.read_table(out).to_pandas(), pq.read_table(alone).to_pandas()
    assert got["index"].tolist() == list(range(ROWS)) and got["status"].tolist() == want["status"].tolist()
    pd.testing.assert_frame_equal(got[want.columns], want, rtol=1e-9, check_exact=False)
    assert sharding["mode"] == "fsdp2" and sharding["world_size"] == 2 and sharding["sharded_layers"] == 2
    held, whole = sharding["parameter_bytes"]["this_rank"], sharding["parameter_bytes"]["unsharded"]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head = config["vocab_size"] * config["hidden_size"] * 4  # fp32, tied to the embeddings: whole on each rank
    assert held == head + (whole - head) // 2  # the rest halved between the 2 ranks


@pytest.mark.parametrize("fault", ["OutOfMemoryError", "RuntimeError"])
def test_torchrun_fsdp_a_rank_failing_inside_a_pass_ends_the_run_not_hangs_it(tmp_path, tiny_model_dir, data, fault):
    """Rank 1 raises in a decoder layer's forward, mid-pass: its peer waits in that pass's collectives.
    Neither a retry of halves (out of memory) nor the idle passes of drain may start new collectives
    there (they hung): the rank exits, and torchrun ends the run, non-zero, within seconds."""
    launch = tmp_path / "launch.py"
    launch.write_text(
        "import os, sys, torch\n"
        "from transformers.models.llama import modeling_llama as ml\n"
        "forward, seen = ml.LlamaDecoderLayer.forward, []\n"
        "def failing(self, hidden_states, *args, **kwargs):\n"  # the second layer of a later batch of several
        "    seen.append(1)\n"
        "    if (os.environ['RANK'] == '1' and len(seen) > 4 and self.self_attn.layer_idx == 1\n"
        "            and hidden_states.shape[0] > 1 and not seen.count(0)):\n"
        "        seen.append(0)\n"
        f"        raise torch.{fault}('injected')\n"
        "    return forward(self, hidden_states, *args, **kwargs)\n"
        "ml.LlamaDecoderLayer.forward = failing\n"
        "from gradspec.cli import main; sys.exit(main(sys.argv[1:]))\n")
    proc = _torchrun(str(launch), *_args(tiny_model_dir, data, tmp_path / "s.parquet", "--fsdp", "--chunk-rows", "7"),
                     start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:  # a hang leaves the workers waiting in a collective: end them with their launcher
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0 and "injected" in err
    assert "failed inside a pass" in err


def test_fsdp_needs_torchrun(tmp_path, tiny_model_dir, data, capsys):
    assert main(_args(tiny_model_dir, data, tmp_path / "s.parquet", "--fsdp")) != 0
    assert "--fsdp shards the model across torchrun's processes" in capsys.readouterr().err


def test_lowrank_runs_are_seeded(tmp_path, tiny_model_dir, data):
    tables = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        out = tmp_path / f"{name}.parquet"
        assert main(_args(tiny_model_dir, data, out, "--method", "lowrank", "--rank", "2", "--seed", seed,
                          "--limit", "12")) == 0
        tables.append(pq.read_table(out))
    assert tables[0].equals(tables[1])
    column = "model.layers.0.self_attn.q_proj/nuclear_norm"
    assert not tables[0][column].equals(tables[2][column])
