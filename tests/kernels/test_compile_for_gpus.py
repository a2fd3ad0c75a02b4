"""Every Triton launch the dispatch can make (gradspec.linalg.triton_launches: every kernel, input dtype,
flag and block size) compiles for each architecture of kernels.blocks.BLOCKS (sm_80: A100; sm_90: H100,
H200; sm_100: B200) on the CPU, with no register spill and within the architecture's shared memory per
block, and the fp64 SYRK's dot is DMMA (fp64 mma.sync.aligned.m8n8k4 in its PTX) on all three.

The whole matrix, not a sample of it: benchmarks/gpu/gpu_static.py --subset dispatch compiles it once for the
module (75 kernels, about 40 CPU-seconds over two processes) in its own process, where TRITON_INTERPRET
is unset (conftest sets it here, and the interpreter's kernels cannot be compiled); each launch and
architecture is then one test on its row.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia", reason="this triton has no CUDA backend")

from gradspec.kernels import blocks as block_table  # noqa: E402

from gradspec.choices import DTYPES  # noqa: E402
from gradspec.linalg.triton_launches import triton_launches  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a package at the root of the checkout

from benchmarks.gpu import gpu_static  # noqa: E402

ARCHS = sorted(block_table.BLOCKS)
CASES = [(launch.label, arch) for launch in triton_launches() for arch in ARCHS]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, int], dict]:
    """(label, architecture) -> its row from gpu_static.py, compiled once for the module."""
    out = tmp_path_factory.mktemp("gpu_static") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_static", "--subset", "dispatch",
                           "--json", str(out)], env=env, capture_output=True, text=True, cwd=ROOT)
    if not out.exists():
        pytest.fail(f"gpu_static.py wrote no rows (exit code {done.returncode}):\n{done.stderr[-4000:]}")
    return {(row["label"], row["arch"]): row for row in json.loads(out.read_text())["rows"]}


def test_every_architecture_of_the_block_table_has_its_limits():
    assert ARCHS == [80, 90, 100] and set(ARCHS) <= set(gpu_static.ARCHS)


@pytest.mark.parametrize(("label", "arch"), CASES, ids=[f"{label}@sm_{arch}" for label, arch in CASES])
def test_the_launch_compiles_without_spills_within_shared_memory(compiled, label, arch):
    row = compiled[label, arch]
    assert row["problems"] == []
    assert row["table"] and row["registers"] > 0 and 0 < row["shared"] <= gpu_static.ARCHS[arch].smem_per_block


def test_the_fp64_syrks_dot_is_dmma_where_its_fma_loop_has_none(compiled):
    """The count is read from the PTX, not assumed (32 a loop step at block 32, on all three): any is DMMA.
    The FMA loop (no tl.dot) has none, so the count tells the two apart."""
    syrk = [row for row in compiled.values() if row["kernel"] == "segment_syrk64"]
    assert len(syrk) == 2 * len(DTYPES) * 2 * len(ARCHS)
    for row in syrk:
        assert (row["fp64_mma"] > 0) == row["dot"], (row["label"], row["arch"], row["fp64_mma"])


def test_the_launches_are_every_kernel_dtype_and_flag_the_dispatch_has():
    """From the dispatch's tables: the fp64 SYRK (and its FMA loop) and the fp32 Gram read each model dtype,
    with and without the fused inner product; the sketch's A^T B is fp32 only (no Triton path at fp64)."""
    launches = triton_launches()
    names = [getattr(torch, name) for name in DTYPES]
    by_kernel = {}
    for t in launches:
        by_kernel.setdefault((t.kernel, t.dot), set()).add((t.dtype, t.other))
    every = {(dtype, other) for dtype in names for other in (False, True)}
    assert by_kernel == {("segment_syrk64", True): every, ("segment_syrk64", False): every,
                         ("segment_gram", True): every, ("segment_tdot", True): {(torch.float32, False)}}
    assert len({t.label for t in launches}) == len(launches)


def test_problems_name_a_compile_error_spills_shared_memory_and_an_fp64_dot_without_dmma():
    sm80 = gpu_static.ARCHS[80]
    clean = {"kernel": "segment_syrk64", "dot": True, "registers": 96, "spill_stores": 0, "spill_loads": 0,
             "shared": 32768, "fp64_mma": 32}
    assert gpu_static.problems(clean, sm80) == []
    bad = clean | {"spill_stores": 8, "shared": sm80.smem_per_block + 1, "fp64_mma": 0}
    found = gpu_static.problems(bad, sm80)
    assert len(found) == 3 and "spills" in found[0] and "shared memory" in found[1] and "DMMA" in found[2]
    assert gpu_static.problems(clean | {"dot": False, "fp64_mma": 0}, sm80) == []  # the FMA loop has no dot
    assert gpu_static.problems({"error": "PTXASError: boom"}, sm80) == ["compile error: PTXASError: boom"]


def test_occupancy_takes_the_fewest_blocks_registers_warps_and_shared_memory_allow():
    sm80, sm90 = gpu_static.ARCHS[80], gpu_static.ARCHS[90]
    assert gpu_static.occupancy(32, 4, 0, sm80) == 1.0  # 16 blocks of 4 warps: the warp limit
    assert gpu_static.occupancy(126, 4, 32768, sm80) == 0.25  # 128 regs: 16 warps; 33 KiB of 164: 4 blocks
    assert gpu_static.occupancy(255, 4, 0, sm80) == 0.125  # 256 regs a thread: 8 warps
    assert gpu_static.occupancy(40, 4, 100 * 1024, sm80) == 1 / 16  # one block's shared memory
    assert gpu_static.occupancy(40, 4, 100 * 1024, sm90) == 2 / 16


def test_the_launchers_take_their_blocks_from_the_table_by_device(monkeypatch):
    """On a GPU, its architecture's row of BLOCKS; elsewhere (here: meta tensors) ELSEWHERE's; given
    blocks win over both."""
    from gradspec.kernels import segment_gram

    launched = []
    monkeypatch.setattr(segment_gram, "launch", lambda kernel, grid, *args, **meta: launched.append(meta))
    monkeypatch.setattr(block_table, "architecture", lambda index: 90)
    monkeypatch.setitem(block_table.BLOCKS, 90, {"segment_gram": {"block_t": 16, "block_d": 64}})
    assert block_table.blocks("segment_gram", torch.device("cuda", 0)) == {"block_t": 16, "block_d": 64}
    assert block_table.blocks("segment_gram", torch.device("cuda", 0), block_t=None, block_d=8) == {
        "block_t": 16, "block_d": 8}
    Y, lengths = torch.empty(2, 40, 8, device="meta"), torch.full((2,), 40, device="meta")
    segment_gram.segment_gram_triton(Y, lengths)
    segment_gram.segment_gram_triton(Y, lengths, block_t=16, block_d=8)
    want = block_table.ELSEWHERE["segment_gram"]
    assert [(m["BLOCK_T"], m["BLOCK_D"]) for m in launched] == [(want["block_t"], want["block_d"]), (16, 8)]
