"""transformers' Conv1D (GPT-2): a linear layer whose weight is stored transposed, (d_in, d_out)."""

from __future__ import annotations

from torch import nn

from gradspec.layers.linear import LinearTarget, linear_target
from gradspec.layers.registry import register


@register
def conv1d(model: nn.Module, name: str, module: nn.Module) -> LinearTarget | None:
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return linear_target(model, name, module, transposed=True)
    return None
