"""Running under torchrun (one node or many): this process's shard and GPU, and a gloo group to
agree on the run folder and to wait for every rank before merging. No tensors cross processes,
except under --fsdp (gradspec.runs.fsdp), where the model's weights do."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradspec.files.locks import Shard
from gradspec.options import OptionError

WAIT = timedelta(days=3)  # how long rank 0 waits for the slowest rank before it merges
COLLECTIVE_WAIT = timedelta(minutes=30)  # a collective of --fsdp's passes: a rank that died ends the run in this


def torchrun_shard() -> Shard | None:
    """This rank's shard when torchrun started more than one process, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Shard(int(os.environ["RANK"]), world) if world > 1 else None


def bind_device(device: str) -> str:
    """Under torchrun a bare 'cuda' means this process's own GPU, which is made current here,
    once, before the model loads: library calls that use the current device (Triton launches,
    CuPy, torch.cuda.*) then see this rank's GPU, not GPU 0."""
    if device.startswith("cuda:") and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise OptionError("device", f" {device}: under torchrun each process takes its own GPU (LOCAL_RANK); give "
                          "--device cuda, and CUDA_VISIBLE_DEVICES to choose the GPUs")
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return device


class Group:
    """The torchrun processes, joined over gloo (CPU or GPU runs alike); collectives: GPU tensors
    cross processes too (FSDP on GPUs), over NCCL. The run folder's agreement and the final wait go
    over a gloo group of their own with WAIT (a slow rank may take days); the passes' collectives
    keep COLLECTIVE_WAIT, so a rank that died mid-pass does not hold every GPU for days."""

    def __init__(self, collectives: bool = False) -> None:
        self.backend = "cpu:gloo,cuda:nccl" if collectives else "gloo"
        self.patient = None

    def __enter__(self) -> Group:
        dist.init_process_group(self.backend, timeout=COLLECTIVE_WAIT)
        self.patient = dist.new_group(backend="gloo", timeout=WAIT)
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.destroy_process_group()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def share(self, value: Any) -> Any:
        """Rank 0's value, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.patient)
        return box[0]

    def wait(self) -> None:
        dist.barrier(group=self.patient)
