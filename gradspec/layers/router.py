"""An MoE router as transformers writes it (``…TopKRouter``: Qwen3-MoE, Mixtral, OLMoE, gpt-oss): a
bare ``weight`` (E, d) applied to the tokens as (N T, d) rows, whose forward returns
(logits = x W^T (+ b), routing weights, expert indices). Its gradient is that of the logits, which
reach the loss through the routing weights: role ``router``."""

from __future__ import annotations

from torch import nn

from gradspec.layers.linear import LinearTarget, linear_target
from gradspec.layers.registry import register


@register
def router(model: nn.Module, name: str, module: nn.Module) -> LinearTarget | None:
    weight = getattr(module, "weight", None)
    if type(module).__name__.endswith("TopKRouter") and isinstance(weight, nn.Parameter) and weight.dim() == 2:
        return linear_target(model, name, module, roles=("router",), flat=True)
    return None
