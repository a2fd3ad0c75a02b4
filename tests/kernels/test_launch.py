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
