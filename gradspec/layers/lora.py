"""LoRA adapters (PEFT). A PeftModel is scored as the model it adapts (the same modules). An adapted
layer holds its base layer, scored under the adapted module's own name and role, and the adapter's
lora_A (d_in -> r) and lora_B (r -> d_out), each an nn.Linear: the exact engine scores them like
any linear layer, with d_out or d_in = r (roles lora_A and lora_B, the preset ``lora``).
"""

from __future__ import annotations

from torch import nn

from gradspec.choices import LORA_ROLES


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft PeftModel, else the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) and hasattr(model, "peft_config") else model


# The levels a wrapper adds to module names (FSDP1, torch's checkpoint wrapper, torch.compile): not the model's own
WRAPPER_LEVELS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def adapted(name: str) -> tuple[str, str | None]:
    """(the name a module is scored under, its LoRA role or None): the model's own name, without the
    levels wrappers add; a base layer is scored as the module it sits in (``q_proj.base_layer`` ->
    ``q_proj``); ``q_proj.lora_A.<adapter>`` is lora_A."""
    for level in WRAPPER_LEVELS:
        name = name.replace(level, "")
    parent, _, leaf = name.rpartition(".")
    if leaf == "base_layer":
        return parent, None
    kind = parent.rpartition(".")[2]
    return name, kind if kind in LORA_ROLES else None
