"""Adam preconditioning, as LESS uses it: each pool sample's gradient replaced by the update that a
checkpoint's AdamW state would take for it, so the pool is compared with the task in the direction
training actually moves the weights.

For a part, with the checkpoint's moments m and v, betas (β1, β2), ε and step t, a sample's gradient
G becomes the next step's bias-corrected update (torch's AdamW, weight decay aside):
    m' = β1 m + (1 - β1) G,  v' = β2 v + (1 - β2) G²,  Γ(G) = (m' / (1 - β1^(t+1))) / (sqrt(v' / (1 - β2^(t+1))) + ε)
Elementwise and not linear in G, so it needs each sample's G formed: the dense route only, exact per
sample. (LESS's own code leaves out the bias corrections and puts ε inside the square root.) The task
keeps its plain gradients; several checkpoints are summed with their learning rates as weights
(combine_checkpoints).
"""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gradspec.alignment.kfac import _cached
from gradspec.errors import InputError, OptionInputError
from gradspec.files import load_torch
from gradspec.layers.registry import Part

OPTIMIZER_FILE = "optimizer.pt"  # where transformers' Trainer saves its optimizer's state in a checkpoint


@dataclass
class AdamUpdate:
    """One part's moments (d_out, d_in) and the optimizer's constants: G -> Γ(G)."""

    m: torch.Tensor
    v: torch.Tensor
    betas: tuple[float, float]
    eps: float
    step: int
    _held: dict = field(default_factory=dict, repr=False)

    def pool_gradient(self, G: torch.Tensor) -> torch.Tensor:
        f = _cached(self._held, {"m": self.m, "v": self.v}, G.device, G.dtype)
        (b1, b2), t = self.betas, self.step + 1
        m = (b1 * f["m"] + (1 - b1) * G) / (1 - b1**t)
        v = (b2 * f["v"] + (1 - b2) * G * G) / (1 - b2**t)
        return m / (v.sqrt() + self.eps)


@dataclass
class AdamState:
    """A checkpoint's AdamW state by parameter name: exp_avg, exp_avg_sq, their group's betas, eps,
    lr and the step."""

    moments: dict[str, tuple[torch.Tensor, torch.Tensor]]
    betas: tuple[float, float]
    eps: float
    lr: float
    step: int
    source: str = ""

    def updates(self, parts: list[Part]) -> dict[str, AdamUpdate]:
        """Each part's slice of the moments (as Part.gradient slices .grad), fp64."""
        out = {}
        for p in parts:
            if p.parameter not in self.moments:
                raise ValueError(f"{self.source}: no optimizer state for {p.parameter} (part {p.name}): the checkpoint "
                                 "did not train it; score modules it trained")
            m, v = (p.slice(t).double() for t in self.moments[p.parameter])
            out[p.name] = AdamUpdate(m, v, self.betas, self.eps, self.step)
        return out

    def describe(self) -> dict:
        return {"optimizer_state": self.source, "betas": list(self.betas), "eps": self.eps, "lr": self.lr,
                "step": self.step}


def trainer_parameter_order(model: nn.Module) -> list[str]:
    """The parameters in the order transformers' Trainer gives them to its optimizer: those it decays,
    then the others, each in named_parameters order (Trainer.create_optimizer)."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in trained if n in decay] + [n for n, _ in trained if n not in decay]


def read_adam_state(checkpoint: str | Path, model: nn.Module) -> AdamState:
    """The AdamW state of a transformers Trainer checkpoint (its folder, or its optimizer.pt) for this
    model (the one the checkpoint saved, loaded with it): the whole file checked (adam_state), any
    problem one OptionInputError naming the file and the field."""
    path = Path(checkpoint)
    path = path / OPTIMIZER_FILE if path.is_dir() else path
    try:
        return adam_state(load_torch(path, "an optimizer's state (torch.save) expected"), model, path,
                          str(Path(checkpoint)))
    except FileNotFoundError:
        raise OptionInputError("optimizer_state", f"{checkpoint}: no {OPTIMIZER_FILE} (a transformers Trainer "
                               "checkpoint saves its optimizer's state there)") from None
    except InputError as e:
        raise OptionInputError("optimizer_state", str(e)) from None
    except OSError as e:
        raise OptionInputError("optimizer_state", f"{path}: {e.strerror or e}") from None


def adam_state(saved: object, model: nn.Module, path: str | Path, source: str = "") -> AdamState:
    """A loaded optimizer.pt (torch AdamW's state_dict, as transformers' Trainer saves it) checked whole
    against the model it was saved with: Trainer numbers the parameters, the numbers are matched to names
    by Trainer's own order, and every moment is a finite tensor of its parameter's shape (the second
    >= 0), every group's betas, eps and lr in range and alike, every step a finite count >= 1.
    InputError naming path and the field where anything is not."""
    def problem(field: str, text: str) -> InputError:
        return InputError(f"{path}: {field}: {text}")

    if not isinstance(saved, dict):
        raise InputError(f"{path}: a dict of state and param_groups expected (an optimizer's state_dict, as "
                         f"transformers' Trainer saves it), got {described(saved)}")
    for key, kind in (("state", dict), ("param_groups", list)):
        if not isinstance(saved.get(key), kind) or not saved[key]:
            raise problem(key, f"a non-empty {kind.__name__} expected (an optimizer that has stepped), got "
                          + ("nothing" if key not in saved else described(saved[key])))
    numbers, constants = _parameter_groups(saved["param_groups"], problem)
    names = _trainer_names(model)
    if len(numbers) != len(names):
        raise problem("param_groups", f"state for {len(numbers)} parameters, the model has {len(names)}: not this "
                      "model's optimizer (or not trained by transformers' Trainer on all its weights)")
    parameters = dict(model.named_parameters())
    named = dict(zip(numbers, names, strict=True))
    moments, steps = {}, []
    for k, state in saved["state"].items():
        field = f"state[{k!r}]"
        if k not in named:
            raise problem(field, "no parameter of that number in param_groups: not this model's optimizer")
        if not isinstance(state, dict) or not {"exp_avg", "exp_avg_sq"} <= set(state):
            raise problem(field, "a dict of exp_avg, exp_avg_sq and step expected (an Adam optimizer's state), got "
                          + (f"keys {sorted(map(str, state))}" if isinstance(state, dict) else described(state)))
        shape = tuple(parameters[named[k]].shape)
        m = _moment(state["exp_avg"], shape, named[k], problem, f"{field}.exp_avg")
        v = _moment(state["exp_avg_sq"], shape, named[k], problem, f"{field}.exp_avg_sq")
        if (v < 0).any():
            raise problem(f"{field}.exp_avg_sq", f"{int((v < 0).sum())} of {v.numel()} values negative: a second "
                          "moment is >= 0")
        steps.append(_step(state.get("step"), problem, f"{field}.step"))
        moments[named[k]] = (m, v)
    betas, eps, lr = constants
    return AdamState(moments, betas, eps, lr, max(steps), source)


def _parameter_groups(groups: list, problem) -> tuple[list, tuple[tuple[float, float], float, float]]:
    """The parameter numbers in the groups' order, and the Adam constants (betas, eps, lr) every group
    holds alike."""
    numbers, constants = [], None
    for i, group in enumerate(groups):
        field = f"param_groups[{i}]"
        if not isinstance(group, dict):
            raise problem(field, f"a dict expected, got {described(group)}")
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in params):
            raise problem(f"{field}.params", f"a list of parameter numbers expected, got {described(params)}")
        if set(params) & set(numbers) or len(set(params)) != len(params):
            raise problem(f"{field}.params", "a parameter numbered twice: not an optimizer's state")
        numbers += params
        betas = group.get("betas")
        pair = [_number(b) for b in betas] if isinstance(betas, list | tuple) and len(betas) == 2 else [None]
        if not all(b is not None and 0 <= b < 1 for b in pair):
            raise problem(f"{field}.betas", f"two floats in [0, 1) expected, got {described(betas)}")
        for flag in ("amsgrad", "maximize"):  # each another update than the one Γ is
            if group.get(flag, False) is not False:
                raise problem(f"{field}.{flag}", f"False expected (transformers' Trainer's AdamW), got "
                              f"{described(group[flag])}")
        eps, lr = _number(group.get("eps")), _number(group.get("lr"))
        if eps is None or not 0 < eps < math.inf:
            raise problem(f"{field}.eps", f"a finite number above 0 expected, got {described(group.get('eps'))}")
        if lr is None or not 0 <= lr < math.inf:
            raise problem(f"{field}.lr", f"a finite number >= 0 expected, got {described(group.get('lr'))}")
        here = ((pair[0], pair[1]), eps, lr)
        if constants is not None and here != constants:
            raise problem(field, f"betas, eps and lr {here}, param_groups[0]'s {constants}: one AdamW's state "
                          "expected, its constants alike in every group")
        constants = here
    return numbers, constants


def _trainer_names(model: nn.Module) -> list[str]:
    """The model's parameters in Trainer's order, as Trainer saw them: all trained, whatever the caller
    froze since."""
    was = {p: p.requires_grad for p in model.parameters()}
    model.requires_grad_(True)
    try:
        return trainer_parameter_order(model)
    finally:
        for p, flag in was.items():
            p.requires_grad_(flag)


def _moment(value: object, shape: tuple[int, ...], name: str, problem, field: str) -> torch.Tensor:
    """value checked to be a finite floating tensor of the parameter's shape."""
    if not (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"
            and value.is_floating_point() and tuple(value.shape) == shape):
        other = isinstance(value, torch.Tensor) and tuple(value.shape) != shape
        raise problem(field, f"a float tensor of shape {shape} expected ({name}'s), got {described(value)}"
                      + (": not this model's optimizer" if other else ""))
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        raise problem(field, f"{bad} of {value.numel()} values NaN or infinite: a finite moment expected")
    return value


def _step(value: object, problem, field: str) -> int:
    """value checked to be a finite whole count >= 1."""
    step = _number(value)
    if step is None or not 1 <= step < math.inf or step != int(step):
        raise problem(field, f"a finite count >= 1 expected, got {described(value)}")
    return int(step)


def _number(value: object) -> float | None:
    """value as a float where it is one real number (a plain one or a one-value tensor), else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu" or value.is_complex() or value.dtype == torch.bool:
            return None
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def described(value: object) -> str:
    """What a value is, in a few words: a tensor's dtype and shape, else its type and a short repr."""
    if value is None:
        return "nothing"
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if value.numel() == 1 and value.device.type == "cpu":
            return f"{value.item()!r} (a {dtype} tensor of shape {tuple(value.shape)})"
        return f"a {dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {reprlib.repr(value)}"
