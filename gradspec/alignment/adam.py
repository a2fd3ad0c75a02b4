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

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gradspec.alignment.kfac import _cached
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
    model (the one the checkpoint saved, loaded with it). Trainer numbers the parameters; the numbers
    are matched to names by Trainer's own order and every shape is checked."""
    path = Path(checkpoint)
    path = path / OPTIMIZER_FILE if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{checkpoint}: no {OPTIMIZER_FILE} (a transformers Trainer checkpoint saves its "
                         "optimizer's state there)")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    groups = saved.get("param_groups") or []
    numbers = [k for g in groups for k in g["params"]]
    was = {p: p.requires_grad for p in model.parameters()}
    model.requires_grad_(True)  # the order Trainer saw, whatever the caller froze since
    try:
        names = trainer_parameter_order(model)
    finally:
        for p, flag in was.items():
            p.requires_grad_(flag)
    if len(numbers) != len(names):
        raise ValueError(f"{path}: state for {len(numbers)} parameters, the model has {len(names)}: not this "
                         "model's optimizer (or not trained by transformers' Trainer on all its weights)")
    shapes = dict(model.named_parameters())
    moments = {}
    for k, name in zip(numbers, names, strict=True):
        state = saved["state"].get(k)
        if state is None or "exp_avg_sq" not in state:
            continue  # a parameter without a gradient yet
        if state["exp_avg"].shape != shapes[name].shape:
            raise ValueError(f"{path}: parameter {k}'s state has shape {tuple(state['exp_avg'].shape)}, {name} "
                             f"{tuple(shapes[name].shape)}: not this model's optimizer")
        moments[name] = (state["exp_avg"], state["exp_avg_sq"])
    if not moments:
        raise ValueError(f"{path}: no Adam moments (exp_avg, exp_avg_sq): not an Adam optimizer's state")
    steps = {int(s["step"]) for s in saved["state"].values() if "step" in s}
    group = groups[0]
    return AdamState(moments, tuple(group["betas"]), float(group["eps"]), float(group["lr"]), max(steps),
                     str(Path(checkpoint)))
