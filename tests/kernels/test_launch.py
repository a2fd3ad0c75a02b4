"""Every Triton launch runs under the device of its tensors, and a torchrun rank binds its own GPU."""

import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from gradspec.kernels import launch as launch_module
from gradspec.kernels import segment_gram_triton, segment_tdot_triton

from gradspec.runs import distributed

KERNELS = Path(launch_module.__file__).resolve().parent


@pytest.fixture
def entered(monkeypatch):
    """The devices made current for launches, in order."""
    seen = []

    @contextmanager
    def recording(device):
        seen.append(device)
        yield

    monkeypatch.setattr(launch_module, "device_context", recording)
    return seen


def test_the_kernels_launch_under_their_tensors_device(entered):
    Y = torch.randn(2, 5, 8)
    lengths = torch.tensor([5, 3])
    segment_gram_triton(Y, lengths, Y @ Y.mT)
    segment_tdot_triton(Y, Y, lengths)
    assert entered == [torch.device("cpu"), torch.device("cpu")]


def test_a_launch_refuses_tensors_on_two_devices(entered):
    launched = []
    kernel = {(1,): lambda *args, **meta: launched.append(args)}
    with pytest.raises(ValueError, match="one device"):
        launch_module.launch(kernel, (1,), torch.zeros(1), torch.zeros(1, device="meta"))
    launch_module.launch(kernel, (1,), torch.zeros(1, device="meta"), 3, BLOCK=4)
    assert entered == [torch.device("meta")] and len(launched) == 1


def test_no_kernel_is_launched_except_through_launch():
    """Structural: a Triton launch is written kernel[grid](...); only launch.py may write one."""
    for path in KERNELS.glob("*.py"):
        if path.name != "launch.py":
            assert not re.search(r"_kernel\[[^\]]*\]\s*\(", path.read_text()), path.name


def test_a_torchrun_rank_binds_its_own_gpu_before_loading(monkeypatch):
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert distributed.bind_device("cuda") == "cuda:3" and bound == [3]
    assert distributed.bind_device("cpu") == "cpu" and bound == [3]
    monkeypatch.delenv("LOCAL_RANK")
    assert distributed.bind_device("cuda") == "cuda" and bound == [3]


def test_a_torchrun_rank_refuses_one_named_gpu_for_every_rank(monkeypatch):
    """--device cuda:0 under torchrun put every rank on GPU 0 (and FSDP's shards beside its mesh's device)."""
    from gradspec.options import OptionError

    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("no GPU is bound"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(OptionError, match="each process takes its own GPU"):
        distributed.bind_device("cuda:0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process: the GPU it names
    assert distributed.bind_device("cuda:1") == "cuda:1"


def test_grids_stay_within_cudas_limits_for_long_samples_and_wide_layers(monkeypatch):
    """CUDA takes at most 2**31 - 1 programs on grid axis 0 and 65,535 on axes 1 and 2: a 12,000-token
    sample has 70,500 lower tiles of 32, a 14,336-wide layer 448 column blocks. Shapes only (meta tensors)."""
    from gradspec.kernels import jacobi_eigvalsh, segment_gram, segment_syrk64, segment_tdot

    grids = []
    for module in (segment_gram, segment_syrk64, segment_tdot, jacobi_eigvalsh):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **meta: grids.append(grid))
    Y = torch.empty(3, 12_000, 64, device="meta")
    lengths = torch.full((3,), 12_000, device="meta")
    segment_syrk64.segment_syrk64_triton(Y, lengths)
    segment_syrk64.segment_syrk64_triton(torch.empty(70_000, 16, 8, device="meta"),  # many short samples
                                         torch.full((70_000,), 16, device="meta"))
    segment_gram.segment_gram_triton(Y, lengths)
    segment_tdot.segment_tdot_triton(torch.empty(2, 64, 14_336, device="meta"), torch.empty(2, 64, 14_336,
                                     device="meta"), lengths[:2])
    assert len(grids) == 4
    for grid in grids:
        assert grid[0] < 2**31 and all(g <= 65_535 for g in grid[1:]), grid
