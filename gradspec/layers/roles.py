"""What each scored weight is for (its role), from the module's name; the presets of --modules, as roles,
are gradspec.choices.MODULE_PRESETS."""

from __future__ import annotations

from gradspec.layers.lora import adapted

# Leaf module name -> the roles of its output features, in order.
_ROLES_BY_LEAF = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
    "qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up"),
    "c_attn": ("q", "k", "v"), "c_fc": ("up",),
}


def roles_of(name: str) -> tuple[str, ...]:
    """The roles of a linear-like module's output features, in order, from its name (none: not scored)."""
    name, lora = adapted(name)
    if lora is not None:
        return (lora,)
    parent, _, leaf = name.rpartition(".")
    if leaf == "c_proj":  # GPT-2 uses one name for the attention output and the MLP output
        return ("o",) if parent.endswith("attn") else ("down",)
    return _ROLES_BY_LEAF.get(leaf, ())
