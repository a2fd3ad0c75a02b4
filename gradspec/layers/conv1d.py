"""transformers' Conv1D (GPT-2): a linear layer whose weight is stored transposed, (d_in, d_out)."""

from __future__ import annotations

from torch import nn

from gradspec.layers.registry import Shape, register


@register
def conv1d(module: nn.Module) -> Shape | None:
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        d_in, d_out = module.weight.shape
        return Shape(d_in, d_out, True)
    return None
