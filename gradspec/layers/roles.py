"""What each scored weight is for (its role), from the module's name, and the presets of --modules."""

from __future__ import annotations

from gradspec.choices import MODULE_PRESETS
from gradspec.layers.lora import LORA_ROLES, adapted

ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_ROLES = ("gate", "up", "down")
EXPERT_ROLES = ("expert_gate", "expert_up", "expert_down")
ROUTER_ROLES = ("router",)
ALL_ROLES = ATTENTION_ROLES + MLP_ROLES + EXPERT_ROLES + ROUTER_ROLES
PRESETS = dict(zip(MODULE_PRESETS, (ATTENTION_ROLES, MLP_ROLES, EXPERT_ROLES, ROUTER_ROLES, ALL_ROLES, LORA_ROLES),
                   strict=True))

# Leaf module name -> the roles of its output features, in order.
_ROLES_BY_LEAF = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
    "qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up"),
    "c_attn": ("q", "k", "v"), "c_fc": ("up",),
}


def check_modules(name: str, value: object) -> str:
    """A --modules value (a str or a list of str, kept joined by commas), refused before any model loads where
    a spec is a near miss of a preset (atn, mpl): roles, globs and names are only known against a model."""
    from gradspec.options import OptionError, nearest, typed

    text = typed(name, value, "strs")
    roles = {role for group in PRESETS.values() for role in group}
    for spec in (s.strip() for s in text.split(",")):
        if len(spec) < 3 or spec in PRESETS or spec in roles or any(c in spec for c in "*?[."):
            continue
        near = nearest(spec, list(PRESETS), edits=1)  # one edit: a longer miss may be a module's own name
        if near is not None:
            raise OptionError(name, f"{spec!r}: no preset of that name; did you mean {near!r}? (presets: "
                              f"{', '.join(PRESETS)}; or roles such as q,k, or globs of part names)")
    return text


def roles_of(name: str) -> tuple[str, ...]:
    """The roles of a linear-like module's output features, in order, from its name (none: not scored)."""
    name, lora = adapted(name)
    if lora is not None:
        return (lora,)
    parent, _, leaf = name.rpartition(".")
    if leaf == "c_proj":  # GPT-2 uses one name for the attention output and the MLP output
        return ("o",) if parent.endswith("attn") else ("down",)
    return _ROLES_BY_LEAF.get(leaf, ())
