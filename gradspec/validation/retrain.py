"""One retrain: fine-tune the model from its start weights on some rows of the pool, with the recipe of
`gradspec train` (AdamW, linear decay to 0, gradients clipped to norm 1, as transformers' Trainer does by
default; full weights, or LoRA adapters), then measure every target example's loss.

A plain torch loop, not Trainer: Trainer's set-up would cost more than a small retrain. The loss is
gradspec's: each sample's mean next-token loss over its response tokens (engine.loss), averaged over
the batch, so that a step moves the weights along the mean of the per-sample gradients the scores are
made of (an objectives retrain takes another loss and data order: objective_losses). The start weights
are copied once and restored before and after every retrain (never reloaded from disk); the model, its
flags and torch's random state are left as they were found. On the CPU a retrain is deterministic given
its rows and seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, pad_id_of
from gradspec.data.templates import Tokenized
from gradspec.engine.loss import item_losses, response_losses

MAX_GRAD_NORM = 1.0  # Trainer's default, which gradspec train keeps


@dataclass(frozen=True)
class Recipe:
    """How each retrain trains (ValidateConfig's fields of the same names)."""

    epochs: float = 1.0
    max_steps: int = -1
    batch_size: int = 4
    learning_rate: float = 2e-5
    lora_rank: int | None = None

    def steps(self, rows: int) -> int:
        """Optimizer steps for rows rows: max_steps, else the epochs' worth of batches (rounded up)."""
        if self.max_steps != -1:
            return self.max_steps
        return max(1, math.ceil(self.epochs * math.ceil(rows / self.batch_size)))


@dataclass(frozen=True)
class Retrained:
    """What one retrain gives: each target's loss after it (NaN: no response token), the mean training
    batch loss, the steps, the metric (None: none asked) and its wall time."""

    target_loss: list[float]
    train_loss: float
    steps: int
    metric: float | None
    seconds: float


class Objective(Protocol):
    """What a retrain trains with instead of NTP (objective_losses: the objectives test)."""

    def batches(self, members: list[int], recipe: Recipe, seed: int) -> list[list[int]]:
        """The rows of each step (row indices of members), as many steps as recipe takes for members."""
        ...

    def loss(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
        """The batch's loss (a scalar to backpropagate); labels: -100 but on the response tokens."""
        ...


def batches(members: list[int], recipe: Recipe, seed: int) -> list[list[int]]:
    """The rows of each step: a fresh permutation of the members per epoch (from the seed), cut into
    batches (the last of an epoch may be smaller), for as many steps as the recipe takes."""
    g = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    while len(out) < recipe.steps(len(members)):
        order = [members[i] for i in torch.randperm(len(members), generator=g).tolist()]
        out += [order[k:k + recipe.batch_size] for k in range(0, len(order), recipe.batch_size)]
    return out[:recipe.steps(len(members))]


class Retrainer:
    """Retrains one model, each time from the same start. rows: the pool's tokens by row index; targets:
    the target examples, in target-file order; metric: called as metric(model, tokenizer) after each."""

    def __init__(self, model: torch.nn.Module, tokenizer, rows: dict[int, Tokenized], targets: list[Item],
                 recipe: Recipe, metric: Callable[[torch.nn.Module, object], float] | None = None,
                 batch_tokens: int = BATCH_TOKENS) -> None:
        self.model, self.tokenizer, self.rows, self.targets = model, tokenizer, rows, targets
        self.recipe, self.metric, self.batch_tokens = recipe, metric, batch_tokens
        self.device = next(model.parameters()).device
        self.start = {k: v.detach().clone() for k, v in model.state_dict().items()}  # once, kept in memory

    def target_losses(self) -> list[float]:
        """Each target's mean response loss under the model as it is now, in target order."""
        by_item = {id(item): loss for item, loss, _ in item_losses(self._net(self.model), self.tokenizer,
                                                                   self.targets, self.batch_tokens)}
        return [by_item[id(item)] for item in self.targets]

    def __call__(self, members: list[int], seed: int, objective: Objective | None = None) -> Retrained:
        """Fine-tunes on members (row indices) with seed (data order, adapters' initialisation, dropout)
        from the start weights, measures the targets, and puts the start weights back. objective: another
        loss and data order than NTP's (objective_losses: the objectives test); None: NTP."""
        began = time.perf_counter()
        flags = {name: (p.requires_grad, p.grad) for name, p in self.model.named_parameters()}
        training = self.model.training
        devices = [self.device] if self.device.type == "cuda" else []
        peft = None
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                self.model.load_state_dict(self.start)
                if self.recipe.lora_rank is not None:
                    peft = _with_lora(self.model, self.recipe.lora_rank)
                trainable = self._trainable(peft)
                train_loss, steps = self._train(trainable, members, seed, objective)
                self.model.eval()
                losses = self.target_losses()
                metric = None if self.metric is None else float(self.metric(self._net(self.model), self.tokenizer))
        finally:
            if peft is not None:
                peft.unload()  # the adapters' layers out again, the base layers as they were
            self.model.load_state_dict(self.start)
            for name, p in self.model.named_parameters():
                p.requires_grad_(flags[name][0])
                p.grad = flags[name][1]
            self.model.train(training)
        return Retrained(losses, train_loss, steps, metric, time.perf_counter() - began)

    def _trainable(self, peft) -> list[torch.nn.Parameter]:
        """The parameters a retrain updates: the adapters' with LoRA, else every weight."""
        if peft is not None:
            return [p for p in peft.parameters() if p.requires_grad]
        for p in self.model.parameters():
            p.requires_grad_(True)
        return list(self.model.parameters())

    def _train(self, params: list[torch.nn.Parameter], members: list[int], seed: int,
               objective: Objective | None = None) -> tuple[float, int]:
        """The training loop; returns (mean batch loss, steps)."""
        net, pad_id = self._net(self.model), pad_id_of(self.tokenizer)
        steps = batches(members, self.recipe, seed) if objective is None else objective.batches(members, self.recipe,
                                                                                                seed)
        optimizer = torch.optim.AdamW(params, lr=self.recipe.learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / len(steps))
        self.model.train()
        total = 0.0
        for batch in steps:
            ids, mask, labels = pad_batch([self.rows[i] for i in batch], pad_id, self.device)
            loss = response_losses(net, ids, mask, labels)[0].mean() if objective is None else \
                objective.loss(net, ids, mask, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            total += float(loss.detach())
        return total / len(steps), len(steps)

    @staticmethod
    def _net(model: torch.nn.Module) -> torch.nn.Module:
        """The transformers model itself (a PEFT model's base, its adapters inside): engine.loss applies
        its LM head at the labelled positions through its base_model."""
        return model.get_base_model() if hasattr(model, "get_base_model") else model


def _with_lora(model: torch.nn.Module, rank: int):
    """The model with fresh LoRA adapters on every linear layer (peft injects them in place; the caller
    unloads them), initialised from torch's current seed."""
    from peft import LoraConfig, get_peft_model

    if hasattr(model, "get_base_model"):
        raise ValueError("--lora-rank adds adapters to a plain model; this model is already a PEFT adapter: merge "
                         "it into its base first (merge_and_unload) or train its full weights")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules="all-linear"))
