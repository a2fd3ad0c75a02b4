"""The layer kinds gradspec can score, one small module each, registered here.

A kind looks at each module of a model and, where it recognises one, returns a Target: the logical
weights (Parts) the module holds, which slice of which parameter each one is (what the reference
differentiates), and how its hooks give each sample's inputs X and output gradients D
(``Target.attach``, gradspec.layers.hooks). The per-sample gradient is D^T X whatever the kind, so
nothing downstream needs to know it: supporting a new layer type is one registered function.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import nn


@dataclass(frozen=True)
class Part:
    """One scored weight matrix, d_out x d_in: columns <name>/<metric> in the output.

    It is ``parameter[index]`` of the model (stored (d_in, d_out) where transposed), and its output
    features are ``features`` (start, stop, step) of the D its target captures. A routed part (an
    expert) sees only the tokens routed to it: a sample that sends it none has no values there.

    Args:
        name: The output's column prefix, <name>/<metric>: the module's name, or the module's and the
            part's where one module holds several (fused projections, experts).
        role: The part's role (q, k, v, o, gate, up, down, router, ...): presets and reports group by it.
        d_in: Its input features.
        d_out: Its output features.
        parameter: The model's parameter (named as in named_parameters) that holds it.
        index: Its block of that parameter (() for the whole), as for ``parameter[index]``.
        transposed: Whether the parameter stores it (d_in, d_out), as GPT-2's Conv1D does.
        features: Its output features within the D its target captures, as (start, stop, step).
        routed: Whether it sees only the tokens routed to it (an expert).
    """

    name: str
    role: str
    d_in: int
    d_out: int
    parameter: str
    index: tuple = ()
    transposed: bool = False
    features: tuple[int | None, int | None, int | None] = (None, None, None)
    routed: bool = False

    def output_features(self, D: torch.Tensor) -> torch.Tensor:
        """This part's columns of a captured output gradient.

        Args:
            D: A captured output gradient (..., the target's output features).

        Returns:
            D's columns of this part (..., d_out).
        """
        return D[..., slice(*self.features)]

    def slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """Its block of a tensor shaped like its parameter: the reference reads gradients and optimizer
        moments per part this way.

        Args:
            tensor: Shaped like the part's parameter (its .grad, an optimizer's moments).

        Returns:
            The (d_out, d_in) block (a view).
        """
        block = tensor[self.index]
        return block.T if self.transposed else block

    def gradient(self, parameters: dict[str, torch.Tensor]) -> torch.Tensor:
        """Its gradient, as the reference (autograd) left it.

        Args:
            parameters: The model's named parameters, after a backward.

        Returns:
            The (d_out, d_in) block of its parameter's .grad.
        """
        return self.slice(parameters[self.parameter].grad)

    def take(self, rows: tuple[int, ...]) -> Part:
        """The part that these rows of its Captured belong to (a Stack's rows belong to several members).

        Args:
            rows: Positions of rows of its Captured, increasing.

        Returns:
            Itself (a Stack: the stack of those rows' members).
        """
        return self

    def member(self, row: int) -> Part:
        """The part that one row of its Captured belongs to.

        Args:
            row: A row's position in its Captured.

        Returns:
            Itself (a Stack: that row's member).
        """
        return self


@dataclass(frozen=True)
class Stack(Part):
    """Parts of one role delivered in one Captured (every expert of an experts module): its row k is a
    segment of members[k]'s tokens of one sample. Shaped like each member (d_in, d_out, output
    features); named for its delivery, once per batch. A capture that takes stacks
    (Capture.takes_stacks) forms each row's Gram and spectrum as it would the member's own."""

    members: tuple[Part, ...] = ()

    @classmethod
    def of(cls, name: str, members: tuple[Part, ...]) -> Stack:
        return cls(**{f.name: getattr(members[0], f.name) for f in fields(Part)} | {"name": name}, members=members)

    def take(self, rows: tuple[int, ...]) -> Stack:
        if len(rows) == len(self.members):  # rows are positions, increasing: all of them
            return self
        return Stack.of(self.name, tuple(self.members[k] for k in rows))

    def member(self, row: int) -> Part:
        return self.members[row]


class Target:
    """A module whose parts are scored, and how it is captured: ``attach`` installs hooks that call
    deliver(part, captured) for each part as its output gradient arrives in the backward. A layer kind
    with its own capture subclasses it (gradspec/layers/experts.py); a linear-like one uses
    ``linear_target``.

    Args:
        name: The module's name in the model.
        module: The module.
        parts: The weight matrices it holds that are scored.
    """

    kind = ""  # the registered kind that recognised the module (set by target_of)

    def __init__(self, name: str, module: nn.Module, parts: tuple[Part, ...]) -> None:
        self.name, self.module, self.parts = name, module, tuple(parts)

    def with_parts(self, parts: tuple[Part, ...]) -> Target:
        """The same target, scoring only some of its parts (a preset or --modules chose them).

        Args:
            parts: The parts kept, among its own.

        Returns:
            A copy of this target with those parts.
        """
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__, parts=tuple(parts))
        return other

    def attach(self, batch, deliver: Callable) -> list:
        """Installs the hooks that capture each part's inputs and output gradients for one batch.

        Args:
            batch: The batch's layout (gradspec.layers.hooks.BatchLayout): which tokens are whose.
            deliver: Called as deliver(part, captured) as each part's output gradient arrives.

        Returns:
            The hooks' handles, each with .remove().
        """
        raise NotImplementedError

    def describe(self) -> dict | None:
        """What a score file should record of how this target was captured.

        Returns:
            A JSON-ready dict, or None where there is nothing to record.
        """
        return None


# A kind: (model, module name, module) -> the module's Target, or None where the kind does not recognise it.
LayerKind = Callable[[nn.Module, str, nn.Module], "Target | None"]
LAYER_KINDS: list[LayerKind] = []


def register(kind: LayerKind) -> LayerKind:
    """Registers a layer kind (usable as a decorator); kinds registered later are asked first, so a
    user's kind can take over a module a built-in one would claim.

    Args:
        kind: (model, module name, module) -> the module's Target (e.g. from linear_target), or
            None where the kind does not recognise the module. Engines built after use it.

    Returns:
        kind itself.
    """
    LAYER_KINDS.insert(0, kind)
    return kind


_FSDP1_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(module id, name): shape}


def parameter_shape(model: nn.Module, module: nn.Module, name: str) -> torch.Size:
    """The full shape of a module's parameter, whatever shards it: FSDP2's DTensor has it; FSDP1 with
    use_orig_params leaves a flat shard of it on the module outside the forward, the shape kept by its
    flat parameter; DeepSpeed ZeRO-3 an empty tensor, the shape kept as its ds_shape."""
    if model not in _FSDP1_SHAPES:
        from torch.distributed.fsdp import FullyShardedDataParallel

        shapes = {}
        for wrapper in model.modules():
            flat = getattr(getattr(wrapper, "_handle", None), "flat_param", None)
            if isinstance(wrapper, FullyShardedDataParallel) and flat is not None:
                shapes |= {(id(info.module), info.param_name): shape
                           for info, shape in zip(flat._param_infos, flat._shapes, strict=True)}
        _FSDP1_SHAPES[model] = shapes
    tensor = getattr(module, name)
    return _FSDP1_SHAPES[model].get((id(module), name)) or getattr(tensor, "ds_shape", None) or tensor.shape


def target_of(model: nn.Module, name: str, module: nn.Module) -> Target | None:
    """The Target of the first registered kind that recognises this module, else None."""
    for kind in LAYER_KINDS:
        target = kind(model, name, module)
        if target is not None:
            target.kind = getattr(kind, "__name__", repr(kind))
            return target
    return None
