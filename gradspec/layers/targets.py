"""Which layers are scored: each module of a registered kind (gradspec.layers.registry) whose
name gives it a role, cut into parts.

A part is one logical weight matrix: q/k/v/o in attention, gate/up/down in the MLP; fused
projections are split along their output features (gradspec.layers.fused).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from torch import nn

from gradspec.layers.fused import split_sizes
from gradspec.layers.lora import LORA_ROLES, adapted, unwrap
from gradspec.layers.registry import shape_of

ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_ROLES = ("gate", "up", "down")
PRESETS = {"attn": ATTENTION_ROLES, "mlp": MLP_ROLES, "all": ATTENTION_ROLES + MLP_ROLES, "lora": LORA_ROLES}

# Leaf module name -> the roles of its output features, in order.
_ROLES_BY_LEAF = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
    "qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up"),
    "c_attn": ("q", "k", "v"), "c_fc": ("up",),
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Part:
    """One scored weight matrix: columns <name>/<metric> in the output."""

    name: str
    role: str
    start: int  # first output feature of this part in its module's output
    d_out: int
    d_in: int


@dataclass(frozen=True)
class Target:
    """A hooked module and the parts of its output that are scored."""

    name: str
    module: nn.Module
    d_in: int
    parts: tuple[Part, ...]
    transposed: bool  # Conv1D stores its weight as (d_in, d_out)


def layer_index(name: str) -> int:
    """The transformer block a module belongs to (-1 when the name has none)."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else -1


def _roles(name: str) -> tuple[str, ...]:
    name, lora = adapted(name)
    if lora is not None:
        return (lora,)
    parent, _, leaf = name.rpartition(".")
    if leaf == "c_proj":  # GPT-2 uses one name for the attention output and the MLP output
        return ("o",) if parent.endswith("attn") else ("down",)
    return _ROLES_BY_LEAF.get(leaf, ())


def _selected(part_name: str, role: str, patterns: tuple[str, ...]) -> bool:
    return any(p == role or fnmatch.fnmatchcase(part_name, p) for p in patterns)


def select_targets(model: nn.Module, modules: str | list[str] = "attn") -> list[Target]:
    """Targets for a preset ('attn', 'mlp', 'all', 'lora'), role names ('q,k') or name globs ('*.3.*q_proj');
    a PEFT model's are those of the model it adapts (gradspec.layers.lora)."""
    model = unwrap(model)
    specs = modules.split(",") if isinstance(modules, str) else list(modules)
    groups = {spec: PRESETS.get(spec, (spec,)) for spec in (s.strip() for s in specs if s.strip())}
    patterns: tuple[str, ...] = tuple(p for group in groups.values() for p in group)
    targets, candidates, found = [], [], []  # found: the roles this model's parts have, in order
    for name, module in model.named_modules():
        shape = shape_of(module)
        roles = _roles(name)
        if shape is None or not roles:
            continue
        d_in, d_out, transposed = shape
        sizes = split_sizes(model, roles, d_out) if len(roles) > 1 else (d_out,)
        parts, start = [], 0
        scored_as = adapted(name)[0]
        for role, size in zip(roles, sizes, strict=True):
            part_name = f"{scored_as}.{role}" if len(roles) > 1 else scored_as
            candidates.append(part_name)
            found.append(role)
            if _selected(part_name, role, patterns):
                parts.append(Part(part_name, role, start, size, d_in))
            start += size
        if parts:
            targets.append(Target(name, module, d_in, tuple(parts), transposed))
    scored = [p for t in targets for p in t.parts]
    unmatched = [spec for spec, group in groups.items() if not any(_selected(p.name, p.role, group) for p in scored)]
    if not targets or unmatched:
        what = f"--modules {','.join(specs)!r}" if not targets else f"{', '.join(map(repr, unmatched))} of --modules"
        if not candidates:
            raise ValueError(f"no module matches {what}: this model has no layer of a kind gradspec scores "
                             "(gradspec.layers.registry lists them)")
        raise ValueError(f"no module matches {what}; pass a preset ({', '.join(PRESETS)}), a role of this model "
                         f"({', '.join(dict.fromkeys(found))}) or a glob of its part names (e.g. {candidates[0]!r}; "
                         f"{len(candidates)} in all)")
    return targets
