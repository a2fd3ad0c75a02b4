"""The Trainer checkpoint a resumed `gradspec train` continues from, vetted before transformers'
Trainer reads it: each file Trainer (or gradspec) reads there is a regular file in the format it is
read in (torch.load's weights_only, JSON, safetensors), holding what is applied from it, so that a
crafted or damaged checkpoint is one line naming the file, never a traceback or code run from it.
What Trainer still raises while it loads them is named the same way (named_load_errors).

training_args.bin is left alone: transformers' Trainer only writes it (torch.save of its
TrainingArguments, a pickle by design) and does not read it on resume, nor does gradspec."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import re
import types
import typing
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gradspec.alignment.adam import OPTIMIZER_FILE, adam_state, described
from gradspec.data.errors import InputError, OptionInputError
from gradspec.data.readers import read_json
from gradspec.files import load_failure, load_torch, regular
from gradspec.training.dynamics import SAVED, read_kept

TRAINER_STATE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
RNG_STATE = re.compile(r"rng_state(_\d+)?\.pth")  # rng_state_<rank>.pth under torchrun
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
WEIGHTS_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
COUNTERS = ("last_epoch", "_step_count", "step")  # the state's whole numbers: the rest may be any number
TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")  # the optim values whose optimizer.pt is torch AdamW's

# What Trainer reads while it resumes, by its method that reads it (one a later transformers lacks is left as is)
LOADERS = {"_load_from_checkpoint": "the model's weights", "_load_rng_state": "rng_state.pth",
           "_load_optimizer_and_scheduler": f"{OPTIMIZER_FILE}, {SCHEDULER_FILE}", "_load_scaler": SCALER_FILE,
           "_load_callback_state": TRAINER_STATE}


def vet_checkpoint(checkpoint: str | Path, trainer, indices: list[int]) -> None:
    """Every file in checkpoint that a resume reads, checked before trainer does: the trainer state, the
    model's config and weights (their shapes the model's), the RNG states (applied to throwaway
    generators), the optimizer's state (torch AdamW's checked whole against the model), the scheduler's
    and scaler's (each like the one trainer makes), the dynamics measured so far (of these sample
    indices).

    Raises:
        OptionInputError: naming resume, the file and what is wrong in it.
    """
    checkpoint = Path(checkpoint)
    try:
        _vet(checkpoint, trainer, indices)
    except (InputError, OSError) as e:
        raise OptionInputError("resume", f": {e}") from None


def _vet(checkpoint: Path, trainer, indices: list[int]) -> None:
    _trainer_state(checkpoint / TRAINER_STATE)
    if (checkpoint / "config.json").exists():
        _json_object(checkpoint / "config.json")
    shapes = {k: tuple(v.shape) for k, v in trainer.model.state_dict().items()}
    for name in WEIGHTS + WEIGHTS_INDEX:
        if (checkpoint / name).exists():
            _weights(checkpoint, name, shapes)
    for path in sorted(checkpoint.iterdir()):
        if RNG_STATE.fullmatch(path.name):
            _rng_state(path)
    groups = _optimizer(checkpoint / OPTIMIZER_FILE, trainer) if (checkpoint / OPTIMIZER_FILE).exists() else 2
    if (checkpoint / SCHEDULER_FILE).exists():
        _scheduler(checkpoint / SCHEDULER_FILE, trainer.args, groups)
    if (checkpoint / SCALER_FILE).exists():
        _dict(load_torch(checkpoint / SCALER_FILE), checkpoint / SCALER_FILE, "a GradScaler's state")
    if (checkpoint / SAVED).exists():
        read_kept(checkpoint / SAVED, indices)


@contextmanager
def named_load_errors(trainer, checkpoint: str | Path | None) -> Iterator[None]:
    """While trainer resumes from checkpoint, what its loaders raise (pickle's, torch's, a state that does
    not fit) is one OptionInputError naming resume and the files being read."""
    if checkpoint is None:
        yield
        return
    for name, files in LOADERS.items():
        if hasattr(trainer, name):
            setattr(trainer, name, _named(getattr(trainer, name), f"{checkpoint}: {files}"))
    try:
        yield
    finally:
        for name in LOADERS:
            trainer.__dict__.pop(name, None)


def _named(load, files: str):
    """load, raising one OptionInputError naming files for whatever it raises; the warnings it gives are
    given after it, where it succeeds (torch warns about a pickle's protocol before refusing it)."""
    @functools.wraps(load)
    def named(*args, **kwargs):
        with warnings.catch_warnings(record=True) as given:
            warnings.simplefilter("always")  # each one kept here, given after under the caller's filters
            try:
                result = load(*args, **kwargs)
            except Exception as e:  # whatever reading or applying a checkpoint's file raises
                raise OptionInputError("resume", f": {files}: not loadable ({load_failure(e)})") from e
        for w in given:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        return result
    return named


def _json_object(path: Path) -> dict:
    data = read_json(path)
    return _dict(data, path, "a JSON object")


def _dict(value: object, path: Path, what: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{path}: {what} expected, got {type(value).__name__}")
    return value


def _trainer_state(path: Path) -> None:
    """Trainer's state: each field of TrainerState's, of its type (numbers finite), the step >= 0."""
    from transformers import TrainerControl, TrainerState

    data = _json_object(path)
    kinds = typing.get_type_hints(TrainerState)
    for key, value in data.items():
        if key not in kinds:
            raise InputError(f"{path}: {key}: none of TrainerState's fields")
        if key == "stateful_callbacks":
            _callbacks(value, path, {f.name for f in dataclasses.fields(TrainerControl)})
        elif not _fits(value, kinds[key]):
            wide = isinstance(value, int) and not isinstance(value, bool) and _fits(0, kinds[key])
            raise InputError(f"{path}: {key}: {_kind_words(kinds[key])}{' within 64 bits' if wide else ''} expected, "
                             f"got {described(value)}")
    if data.get("global_step", 0) < 0:
        raise InputError(f"{path}: global_step: a step >= 0 expected, got {data['global_step']}")


def _callbacks(value: object, path: Path, control_flags: set[str]) -> None:
    """Trainer's stateful_callbacks: each callback's (or callbacks') args and attributes, TrainerControl's
    flags among its own."""
    if not isinstance(value, dict):
        raise InputError(f"{path}: stateful_callbacks: an object expected, got {described(value)}")
    for name, saved in value.items():
        for state in saved if isinstance(saved, list) else [saved]:
            if not (isinstance(state, dict) and set(state) <= {"args", "attributes"}
                    and all(isinstance(state.get(k, {}), dict) for k in ("args", "attributes"))):
                raise InputError(f"{path}: stateful_callbacks: {name}: an object of args and attributes expected, "
                                 f"got {described(state)}")
            flags = {**state.get("args", {}), **state.get("attributes", {})}
            if name == "TrainerControl" and not all(k in control_flags and isinstance(v, bool)
                                                    for k, v in flags.items()):
                raise InputError(f"{path}: stateful_callbacks: TrainerControl: its flags (true or false) expected, "
                                 f"got {described(flags)}")


def _fits(value: object, kind: Any) -> bool:
    """Whether a JSON value is of a type annotation's kind (int, float, bool, str, list, dict, X | None)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return any(_fits(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    base = typing.get_origin(kind) or kind
    if isinstance(value, bool):
        return base is bool
    if base in (int, float) and isinstance(value, int):
        return -(2**63) <= value < 2**63
    if base is float:
        return isinstance(value, float) and math.isfinite(value)
    return isinstance(value, base) if isinstance(base, type) else True


def _kind_words(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)


def _weights(checkpoint: Path, name: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """A weights file (or an index and its shards): readable, each tensor finite and of the model's shape."""
    import torch

    path = checkpoint / name
    if name.endswith(".index.json"):
        weight_map = _json_object(path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError(f"{path}: weight_map: an object of tensor name -> shard file expected")
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or shard in (".", ".."):
                raise InputError(f"{path}: weight_map: {shard!r}: a file in the checkpoint's folder expected")
            _weights(checkpoint, shard, shapes)
        return
    tensors = _safetensors(path) if name.endswith(".safetensors") else \
        _dict(load_torch(path), path, "a dict of tensors").items()
    for key, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"{path}: {key}: a tensor expected, got {described(tensor)}")
        if key in shapes and tuple(tensor.shape) != shapes[key]:
            raise InputError(f"{path}: {key}: shape {tuple(tensor.shape)}, the model's {shapes[key]}: not this "
                             "model's weights")
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
        if bad:
            raise InputError(f"{path}: {key}: {bad} of {tensor.numel()} values NaN or infinite: finite weights "
                             "expected")


def _safetensors(path: Path) -> Iterator[tuple[str, Any]]:
    """A safetensors file's tensors, one at a time."""
    from safetensors import safe_open

    regular(path)
    try:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except Exception as e:  # safetensors' own error, or what its header parser meets
        raise InputError(f"{path}: not a readable safetensors file ({load_failure(e)})") from e


def _rng_state(path: Path) -> None:
    """Trainer's RNG states, each set on a throwaway generator of its kind as Trainer sets the global one."""
    import numpy as np
    import torch
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # the NumPy types Trainer allows in this file
        state = _dict(load_torch(path), path, "a dict of RNG states")
    for key, apply in (("python", random.Random().setstate), ("numpy", np.random.RandomState().set_state),
                       ("cpu", torch.Generator().set_state)):
        if key not in state:
            raise InputError(f"{path}: {key}: missing; Trainer's RNG states (python, numpy, cpu) expected")
        try:
            apply(state[key])
        except Exception as e:  # whatever setting a generator to a crafted state raises
            raise InputError(f"{path}: {key}: not a {key} RNG state ({load_failure(e)})") from e


def _optimizer(path: Path, trainer) -> int:
    """The optimizer's state: its groups like those of the optimizer trainer makes; torch AdamW's state
    checked whole against the model (under FSDP or DeepSpeed, which keep their own layout: loadable). The
    number of its groups."""
    saved = load_torch(path)
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        return 2
    saved = _dict(saved, path, "an optimizer's state_dict (state and param_groups)")
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or \
            not isinstance(saved.get("state"), dict):
        raise InputError(f"{path}: an optimizer's state_dict (state, and param_groups: a list of dicts) expected")
    made = _made_optimizer_group(trainer)
    for i, group in enumerate(groups if made is not None else ()):  # None: an optimizer's groups left to Trainer
        _like({k: v for k, v in group.items() if k != "params"}, made, f"param_groups[{i}]", path, extra=True)
    if trainer.args.optim in TORCH_ADAMW:
        adam_state(saved, trainer.model, path)
    return len(groups)


def _made_optimizer_group(trainer) -> dict | None:
    """A parameter group of the optimizer trainer makes (on a throwaway parameter), with the
    initial_lr its scheduler adds; None where it cannot be made so."""
    import torch

    try:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
        group = dict(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs).param_groups[0])
    except Exception:  # an optimizer that needs more than a CPU tensor: its groups are left to Trainer
        return None
    group.pop("params")
    return {**group, "initial_lr": group.get("lr")}


def _scheduler(path: Path, args, groups: int) -> None:
    """The scheduler's state like that of the scheduler Trainer makes (its keys alone: the rest become
    the scheduler's attributes)."""
    import torch
    from transformers import get_scheduler

    saved = _dict(load_torch(path), path, "a scheduler's state_dict")
    try:
        params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(max(groups, 1))]
        made = get_scheduler(args.lr_scheduler_type, torch.optim.SGD(params, lr=1e-3), num_warmup_steps=0,
                             num_training_steps=10, scheduler_specific_kwargs=args.lr_scheduler_kwargs).state_dict()
    except Exception:  # a scheduler that needs more: its state is left to Trainer
        return
    _like(saved, made, "", path, extra=False)


def _like(value: object, made: object, field: str, path: Path, extra: bool) -> None:
    """value checked to be of the make of made, an object of the same kind freshly made: a dict with
    made's keys alone (extra: others too), each value alike; a list of as many values alike; a number
    (finite where made's is, >= 0 where made's is, whole for COUNTERS); a bool; a flag or None where made holds None."""
    def problem(text: str) -> InputError:
        return InputError(f"{path}: {field.lstrip('.') or 'the state'}: {text}")

    if made is None:
        if value is not None and not isinstance(value, bool):
            raise problem(f"true, false or null expected, got {described(value)}")
    elif isinstance(made, bool):
        if not isinstance(value, bool):
            raise problem(f"true or false expected, got {described(value)}")
    elif isinstance(made, int | float):
        whole = isinstance(made, int) and field.rpartition(".")[2] in COUNTERS  # weight_decay=0 is any number
        number = isinstance(value, int | float) and not isinstance(value, bool) and (isinstance(value, int) or
                                                                                     not whole)
        infinite = isinstance(value, float) and not math.isfinite(value) and math.isfinite(made)  # inf where made's
        if not number or infinite or made >= 0 > value:
            raise problem(f"a finite {'whole ' if whole else ''}number{' >= 0' if made >= 0 else ''} expected, got "
                          f"{described(value)}")
    elif isinstance(made, dict):
        if not isinstance(value, dict):
            raise problem(f"a dict expected, got {described(value)}")
        unknown = [k for k in value if k not in made]
        if unknown and not extra:
            raise problem(f"{unknown[0]!r}: none of the keys of the state Trainer makes ({', '.join(made)})")
        for k in value:
            if k in made:
                _like(value[k], made[k], f"{field}.{k}", path, extra)
    elif isinstance(made, list | tuple):
        if not isinstance(value, list | tuple) or len(value) != len(made):
            raise problem(f"{len(made)} values expected, got {described(value)}")
        for i, (v, m) in enumerate(zip(value, made, strict=True)):
            _like(v, m, f"{field}[{i}]", path, extra)
    elif not isinstance(value, type(made)):
        raise problem(f"{type(made).__name__} expected, got {described(value)}")
