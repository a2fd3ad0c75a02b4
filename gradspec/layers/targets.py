"""Which layers are scored: each module a registered kind recognises (gradspec.layers.registry),
and of its parts those that --modules selects, by preset, role or glob of the part's name."""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from gradspec.choices import MODULE_PRESETS
from gradspec.layers.lora import unwrap
from gradspec.layers.registry import Part, Target, target_of
from gradspec.options import OptionError, mention

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The transformer block a module belongs to (-1 when the name has none)."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else -1


def _selected(part: Part, patterns: tuple[str, ...]) -> bool:
    return any(p == part.role or fnmatch.fnmatchcase(part.name, p) for p in patterns)


def select_targets(model: nn.Module, modules: str | list[str] = "attn") -> list[Target]:
    """Targets for a preset (attn, mlp, experts, router, all, lora), role names ('q,k') or name globs
    ('*.3.*q_proj'); a PEFT model's are those of the model it adapts (gradspec.layers.lora)."""
    model = unwrap(model)
    specs = modules.split(",") if isinstance(modules, str) else list(modules)
    groups = {spec: MODULE_PRESETS.get(spec, (spec,)) for spec in (s.strip() for s in specs if s.strip())}
    patterns: tuple[str, ...] = tuple(p for group in groups.values() for p in group)
    targets, candidates = [], []
    for name, module in model.named_modules():
        target = target_of(model, name, module)
        if target is None:
            continue
        candidates.extend(target.parts)
        parts = tuple(p for p in target.parts if _selected(p, patterns))
        if parts:
            targets.append(target.with_parts(parts))
    scored = [p for t in targets for p in t.parts]
    unmatched = [spec for spec, group in groups.items() if not any(_selected(p, group) for p in scored)]
    if not targets or unmatched:
        modules = mention("modules")
        what = f"{modules} {','.join(specs)!r}" if not targets else f"{', '.join(map(repr, unmatched))} of {modules}"
        if not candidates:
            raise OptionError((), f"no module matches {what}: this model has no layer of a kind gradspec scores "
                              "(gradspec.layers.registry lists them)")
        roles = ", ".join(dict.fromkeys(p.role for p in candidates))
        raise OptionError((), f"no module matches {what}; pass a preset ({', '.join(MODULE_PRESETS)}), a role of "
                              f"this model ({roles}) or a glob of its part names (e.g. {candidates[0].name!r}; "
                              f"{len(candidates)} in all)")
    return targets
