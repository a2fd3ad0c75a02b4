"""torch's nn.Linear, weight (d_out, d_in), and the capture every linear-like kind shares: the
module's input X in the forward, its output gradient D in the backward, split into parts by
output features (fused projections: gradspec.layers.fused)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradspec.layers.checkpointing import FIRST, RECOMPUTE, Pairing
from gradspec.layers.fused import split_sizes
from gradspec.layers.lora import adapted
from gradspec.layers.registry import Part, Target, parameter_shape, register
from gradspec.layers.roles import roles_of


def start_graph(output: torch.Tensor) -> torch.Tensor:
    """A scored module's output as the start of the backward's graph where nothing below it needs
    a gradient (parameters are frozen): the backward stops at the lowest scored module instead of
    running down to the embeddings, so scoring the last k of L layers costs about k/L of a backward.
    Its output gradient is unchanged: it depends only on what comes after."""
    return output if output.requires_grad else output.detach().requires_grad_(True)


class LinearTarget(Target):
    """y = x W^T (+ b), or x W where the weight is stored transposed: X is the module's first input,
    D the gradient of its output. ``flat``: a router's layout, tokens as (N T, d) rows and the output
    a tuple whose first element is the logits; the graph then starts at its input, not its output,
    since what its forward computes from the logits (the routing weights) must carry their gradient."""

    def __init__(self, name: str, module: nn.Module, parts: tuple[Part, ...], flat: bool = False) -> None:
        super().__init__(name, module, parts)
        self.flat = flat

    def attach(self, batch, deliver: Callable) -> list:
        pairing = Pairing()  # calls inside checkpointed regions (see layers/checkpointing.py)

        def arrived(X: torch.Tensor, D: torch.Tensor) -> None:
            self._arrived(batch, deliver, X, D)

        def before(module, args):
            if not (isinstance(args[0], torch.Tensor) and torch.is_grad_enabled()):
                return None
            now = batch.phase()
            if now.kind == RECOMPUTE:
                pairing.recomputed(now.frame, as_multiplied(args[0].detach()), arrived)
            if self.flat and not args[0].requires_grad:  # the recompute too: it must save what the first run saved
                return (start_graph(args[0]), *args[1:])
            return None

        def after(module, args, output):
            if not (isinstance(args[0], torch.Tensor) and torch.is_grad_enabled()):
                return None
            now = batch.phase()
            tensor = output[0] if isinstance(output, tuple) else output
            if not isinstance(output, tuple):  # the recompute too: it must save what the first run saved
                tensor = output = start_graph(output)
            if now.kind == RECOMPUTE:  # its gradient comes through the first run's output
                return output
            key = pairing.expect(now.frame) if now.kind == FIRST else None  # every call counts, as in the recompute
            if not tensor.requires_grad:
                return output
            if key is not None:  # X comes again from the recompute: not held until the backward
                tensor.register_hook(lambda grad: pairing.gradient(key, grad.detach(), arrived))
            else:
                X = [as_multiplied(args[0].detach())]  # released once delivered
                tensor.register_hook(lambda grad: arrived(X.pop(), grad.detach()) if X else self._again(batch))
            return output

        return [self.module.register_forward_pre_hook(before), self.module.register_forward_hook(after)]

    def _again(self, batch) -> None:
        """A second backward through one call (retain_graph): its input was released; flagged."""
        batch.repeated.update(p.name for p in self.parts)

    def _arrived(self, batch, deliver: Callable, X: torch.Tensor, D: torch.Tensor) -> None:
        # The input is released once every part is reduced (its storage goes once every module
        # reading it is done), so only what the captures keep stays in flight.
        if X.device != D.device:  # a dispatched model's hook moved the input after ours saw it
            X = X.to(D.device)
        if self.flat:
            X, D = X.reshape(batch.rows, -1, X.shape[-1]), D.reshape(batch.rows, -1, D.shape[-1])
        captured = batch.whole(X, D)
        for part in self.parts:
            deliver(part, captured.with_D(part.output_features(captured.D)))


def as_multiplied(X: torch.Tensor) -> torch.Tensor:
    """X as the layer multiplies it: under autocast, cast to autocast's dtype, as autograd saves it for the
    weight's gradient (holding the fp32 input instead would keep a copy autograd had let go, and form
    another gradient than the one trained on)."""
    device = X.device.type
    if X.is_floating_point() and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if X.dtype not in (dtype, torch.float64):  # autocast leaves fp64 be (its is_eligible)
            return X.to(dtype)
    return X


def linear_target(model: nn.Module, name: str, module: nn.Module, weight: str = "weight",
                  roles: tuple[str, ...] | None = None, transposed: bool = False, flat: bool = False
                  ) -> LinearTarget | None:
    """A linear-like module's target: its weight parameter (d_out, d_in), or (d_in, d_out) where
    transposed, cut into one part per role along its output features (roles: from the module's name
    when not given; none: not scored). For a user's own layer kinds too.

    Args:
        model: The whole model (its config sizes fused projections' parts).
        name: The module's name in the model, as named_modules gives it.
        module: The module; its first input is X and its output's gradient D.
        weight: The name of the module's weight parameter.
        roles: The roles of its output features in order, e.g. ("q", "k", "v") for a fused
            projection; None: from the module's name (gradspec.layers.roles); empty: not scored.
        transposed: The weight is stored (d_in, d_out) (y = x W), as GPT-2's Conv1D.
        flat: A router's layout: tokens as (N T, d) rows and a tuple output whose first element is
            the logits.

    Returns:
        The module's target, or None where it has no role.
    """
    roles = roles_of(name) if roles is None else tuple(roles)
    if not roles:
        return None
    shape = parameter_shape(model, module, weight)
    d_out, d_in = shape[::-1] if transposed else shape
    sizes = split_sizes(model, roles, d_out) if len(roles) > 1 else (d_out,)
    scored_as = adapted(name)[0]
    parts, start = [], 0
    for role, size in zip(roles, sizes, strict=True):
        rows = (slice(None), slice(start, start + size)) if transposed else (slice(start, start + size),)
        parts.append(Part(f"{scored_as}.{role}" if len(roles) > 1 else scored_as, role, d_in, size,
                          f"{name}.{weight}", rows, transposed, (start, start + size, 1)))
        start += size
    return LinearTarget(name, module, tuple(parts), flat)


@register
def linear(model: nn.Module, name: str, module: nn.Module) -> LinearTarget | None:
    return linear_target(model, name, module) if isinstance(module, nn.Linear) else None
