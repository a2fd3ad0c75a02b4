"""torch's nn.Linear: weight (d_out, d_in)."""

from __future__ import annotations

from torch import nn

from gradspec.layers.registry import Shape, register


@register
def linear(module: nn.Module) -> Shape | None:
    if isinstance(module, nn.Linear):
        return Shape(module.in_features, module.out_features, False)
    return None
