"""Fused projections (GPT-2 ``c_attn``, Phi-3 ``qkv_proj`` / ``gate_up_proj``): one module whose
output features are several logical weights side by side, split by the model's head counts."""

from __future__ import annotations

from torch import nn


def split_sizes(model: nn.Module, roles: tuple[str, ...], d_out: int) -> tuple[int, ...]:
    """Output features per role: q/k/v by the attention's head counts (grouped-query attention gives
    k and v fewer), otherwise equal shares."""
    if roles == ("q", "k", "v"):
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads:
            head_dim = getattr(config, "head_dim", None) or d_out // (heads + 2 * kv_heads)
            if head_dim * (heads + 2 * kv_heads) == d_out:
                return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim
    if d_out % len(roles):
        raise ValueError(f"cannot split {d_out} output features into {roles}")
    return (d_out // len(roles),) * len(roles)
