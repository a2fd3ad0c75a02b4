"""Every Triton launch goes through ``launch``, which runs it under the device of its tensors.

Triton launches on the *current* CUDA device. Under torchrun each rank's tensors live on its own
GPU; a kernel launched from another device's context would be handed pointers into a foreign GPU.
``launch`` finds the one device of the tensor arguments (two devices is an error, not a guess)
and makes it current for the launch, so no kernel in this package can run on the wrong GPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def tensors_device(*args: Any) -> torch.device:
    """The one device of the tensors among args."""
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"a kernel's tensors must lie on one device, got {sorted(str(d) for d in devices)}")
    return devices.pop()


def device_context(device: torch.device) -> AbstractContextManager:
    """The context that makes device current for a launch (nothing to switch off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """kernel[grid](*args, **meta), with the tensors' device current."""
    with device_context(tensors_device(*args)):
        kernel[grid](*args, **meta)
