"""Scoring a model larger than one device: its parameters sharded across the torchrun ranks with
FSDP2 (``fully_shard`` per decoder layer, then the base model), each rank scoring its own chunks.

No rank holds the whole model on its device, and only rank 0 reads the weights (into host memory):
every rank builds the model on the meta device and shards it, then allocates its own shards on its
device and receives them from rank 0 (``load_sharded``).

FSDP makes every forward and backward collective (each layer's weights are gathered from all
ranks as it runs), so the ranks must run their passes together although each has its own data:
before each pass they agree whether any still has work (``Lockstep``), and one that has none runs
a one-token pass whose rows are dropped. Hooks see each rank's own full activations, so the rows
are those of one process. The LM head stays whole on every rank (the engine runs it at response
positions alone, outside the base model's forward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradspec.data.templates import IGNORE_INDEX
from gradspec.options import OptionError

log = logging.getLogger("gradspec")


def load_sharded(load: Callable[[str], tuple[nn.Module, Any]], device: str) -> tuple[nn.Module, Any, dict[str, Any]]:
    """(model, tokenizer, sharding): load(where) -> (model, tokenizer) on "cpu", or without weights on
    "meta". Rank 0 reads the weights into host memory; every rank shards the meta model, allocates
    its shards (and the unsharded rest: the LM head, the buffers) on device, and takes rank 0's values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = tokenizer = None
    if dist.get_rank() == 0:
        full, tokenizer = load("cpu")
    dist.barrier()  # the default model is converted once, by rank 0, before the others read its config
    model, own_tokenizer = load("meta")
    tokenizer = own_tokenizer if tokenizer is None else tokenizer
    sharding = shard_model(model, device)
    model.to_empty(device=device)
    state = {} if full is None else full.state_dict()
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():  # not in a state dict where not persistent (rotary frequencies)
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, 0)
    return model, tokenizer, sharding


def shard_model(model: nn.Module, device: str) -> dict[str, Any]:
    """Shards the model's decoder layers and its base model across the process group, in place
    (frozen first: the unsharded weights then need no gradients), on a mesh of device's type (FSDP's
    default mesh takes the machine's accelerator: CUDA for --device cpu on a GPU host); returns the
    sharding, for the score file's metadata."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise OptionError("fsdp", f": {type(model).__name__} names no decoder layer class (_no_split_modules) "
                          "to shard by")
    before = parameter_bytes(model)
    model.requires_grad_(False)
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(getattr(model, "base_model", model), mesh=mesh)
    return {"mode": "fsdp2", "world_size": dist.get_world_size(), "sharded_layers": len(layers),
            "parameter_bytes": {"unsharded": before, "this_rank": parameter_bytes(model)}}


def lockstep_engine(engine, device: str) -> None:
    """The engine's passes (on a sharded model) in lockstep across the ranks."""
    idle = [torch.tensor([[0, 0]], device=device), torch.ones(1, 2, dtype=torch.int64, device=device),
            torch.tensor([[IGNORE_INDEX, 0]], device=device)]  # one response token, its rows dropped
    engine.lockstep = Lockstep(lambda: engine.score(*idle))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a sharded parameter's local shard; a parameter
    shared by two modules, as tied embeddings, once)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class Lockstep:
    """Passes run on every rank together: before each, the ranks agree (a MAX all-reduce) whether
    any has work; a rank out of work runs `idle` passes until none has (``drain``)."""

    def __init__(self, idle) -> None:
        self.idle = idle  # a pass whose results are dropped
        self._idling = False
        self.in_pass = False  # between before_pass and after_pass: the peers are in the same pass's collectives

    def _any(self, working: bool) -> bool:
        flag = torch.tensor([int(working)])  # on the host: gloo's half of the group
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def before_pass(self) -> None:
        """This rank has a pass to run: the others learn so and run one too."""
        if not self._idling:
            self._any(True)
        self.in_pass = True

    def after_pass(self) -> None:
        self.in_pass = False

    def drain(self) -> None:
        """This rank is done: idle passes while another rank still has work. Not after a pass that
        raised midway: its peers wait in that pass's collectives, which a new all-reduce would cross
        (a hang, or all-gathers paired with the wrong layer's); the rank exits instead, and torchrun
        ends the others."""
        if self.in_pass:
            log.error("this rank failed inside a pass: not waiting for the other ranks (torchrun stops them)")
            return
        while self._any(False):
            self._idling = True
            try:
                self.idle()
            finally:
                self._idling = False
