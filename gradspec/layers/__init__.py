"""Which layers are scored, and how each kind of layer is captured: one file per kind (linear.py,
conv1d.py, router.py, experts.py; fused projections in fused.py, LoRA naming in lora.py) registered in
registry.py, the capture protocol in hooks.py, roles and presets in roles.py, the selection in targets.py.

A new layer kind is one registered function (model, name, module) -> Target | None; a linear-like
one builds its Target with ``linear_target``.
"""

from gradspec.layers import conv1d, experts, linear, router  # noqa: F401  (registers the kinds)
from gradspec.layers.linear import LinearTarget, linear_target
from gradspec.layers.registry import Part, Target, register

__all__ = ["LinearTarget", "Part", "Target", "linear_target", "register"]
