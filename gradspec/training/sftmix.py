"""SFTMix ("SFTMix: Elevating Language Model Instruction Tuning with Mixup Recipe").

Confidence is the negative mean perplexity of a sample's response over reference checkpoints
(from the training dynamics); the median splits the data into a confident and an unconfident
half. Every batch pairs confident with unconfident samples; the loss adds to next-token
prediction a Mixup term on the last hidden states (the LM head's input):

    h = lam * h_conf + (1 - lam) * h_unconf,  lam ~ Beta(alpha, alpha), one lam per pair,
    Mixup = lam * CE(head(h), y_conf) + (1 - lam) * CE(head(h), y_unconf),
    loss = NTP + mu * Mixup,

mixed token by token over the response positions, both responses cut to the shorter one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler
from transformers import Trainer

from gradspec.data.templates import IGNORE_INDEX
from gradspec.engine.loss import next_token_nll
from gradspec.training.sample_index import SAMPLE_INDEX

ALPHA = 0.5
MU = 0.2


def confidence_halves(dynamics: pd.DataFrame, trained: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(confident, unconfident): above and below the median of -mean perplexity. With an odd count
    the middle sample goes to the unconfident half. A sample without a perplexity (no response
    token to measure) is in neither: it has nothing to mix.

    Args:
        dynamics: per-sample rows with index and mean_perplexity (a dynamics file's).
        trained: the trained samples' indices in training order; the halves are then split among
            those rows alone and given as positions in it (a reference file may hold more rows).

    Returns:
        The two halves: sample indices, or positions in trained when it is given; each sorted.
    """
    if trained is not None:
        position = {index: k for k, index in enumerate(trained)}
        dynamics = dynamics[dynamics["index"].isin(position)]
        confident, unconfident = confidence_halves(dynamics)
        return sorted(position[i] for i in confident), sorted(position[i] for i in unconfident)
    dynamics = dynamics[np.isfinite(dynamics["mean_perplexity"])]
    ranked = dynamics.assign(confidence=-dynamics["mean_perplexity"]).sort_values(
        ["confidence", "index"], ascending=[False, True], kind="stable")
    order = ranked["index"].tolist()
    half = len(order) // 2
    return sorted(order[:half]), sorted(order[half:])


class PairedBatchSampler(Sampler[list[int]]):
    """Batches of `pairs` confident then `pairs` unconfident positions, row k of one half paired
    with row k of the other. Each epoch shuffles both halves; the smaller half is drawn again
    (reshuffled) until the larger one is used up, so every sample is seen every epoch."""

    def __init__(self, confident: list[int], unconfident: list[int], pairs: int, seed: int = 0) -> None:
        if not confident or not unconfident or pairs < 1:
            raise ValueError("SFTMix needs both halves non-empty and at least one pair per batch: train on at least "
                             "2 samples with --batch-size 2 or more")
        self.confident, self.unconfident, self.pairs, self.seed = confident, unconfident, pairs, seed
        self.epoch = 0

    def __len__(self) -> int:
        return -(-max(len(self.confident), len(self.unconfident)) // self.pairs)

    def _stream(self, half: list[int], rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += [half[i] for i in rng.permutation(len(half))]
        return out[:n]

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        self.epoch += 1
        n = len(self) * self.pairs
        conf, unconf = self._stream(self.confident, rng, n), self._stream(self.unconfident, rng, n)
        for b in range(len(self)):
            yield conf[b * self.pairs:(b + 1) * self.pairs] + unconf[b * self.pairs:(b + 1) * self.pairs]


# Both losses keep every shape fixed by the batch's (no nonzero, no per-row indexing, no length read on the
# host): a training step never waits for the device (tests/training/test_sftmix.py runs them on the meta device).

def _response_ranks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (N, T - 1), counts (N,)): each row's positions whose hidden state predicts a response
    token, in order, first (the k-th of them at column k; the columns past counts are padding)."""
    labelled = labels[:, 1:] != IGNORE_INDEX
    order = torch.argsort((~labelled).to(torch.int8), dim=1, stable=True)
    return order, labelled.sum(1)


def mixup_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, lam: torch.Tensor) -> torch.Tensor:
    """The Mixup term for a batch whose first half is confident and second half unconfident;
    lam holds one coefficient per pair. Mean over the mixed tokens: the k-th response token of
    each sample of a pair, k below the shorter response's length."""
    pairs = len(labels) // 2
    positions, counts = _response_ranks(labels)
    pc, pu = positions[:pairs], positions[pairs:2 * pairs]
    mixed_tokens = torch.arange(pc.shape[1], device=labels.device) < torch.minimum(counts[:pairs],
                                                                                 counts[pairs:2 * pairs])[:, None]
    at = lam.to(hidden.dtype)[:, None, None]
    width = hidden.shape[-1]
    mixed = at * hidden[:pairs].gather(1, pc[..., None].expand(-1, -1, width)) + \
        (1 - at) * hidden[pairs:2 * pairs].gather(1, pu[..., None].expand(-1, -1, width))
    logits = head(mixed).float().flatten(0, 1)
    y_conf = torch.where(mixed_tokens, labels[:pairs, 1:].gather(1, pc), IGNORE_INDEX).flatten()
    y_unconf = torch.where(mixed_tokens, labels[pairs:2 * pairs, 1:].gather(1, pu), IGNORE_INDEX).flatten()
    w = lam.to(logits.dtype)[:, None].expand(mixed_tokens.shape).flatten()
    per_token = w * next_token_nll(logits, y_conf) + (1 - w) * next_token_nll(logits, y_unconf)
    return per_token.sum() / mixed_tokens.sum().clamp_min(1)  # no mixed token: 0, its gradient 0


def ntp_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """Next-token cross-entropy over all response tokens of the batch (token mean)."""
    logits = head(hidden[:, :-1]).flatten(0, 1)
    return next_token_nll(logits, labels[:, 1:].flatten(), reduction="mean")


class SFTMixTrainer(Trainer):
    """Trainer with the SFTMix loss and paired batches; per_device_train_batch_size is 2 x pairs.

    Losses are token means per micro-batch (divided by the accumulation steps, as Trainer does
    for losses that do not take the global token count).

    Args:
        *args: Trainer's positional arguments.
        confident: Dataset positions of the confident half (confidence_halves).
        unconfident: Dataset positions of the unconfident half.
        alpha: The Beta(alpha, alpha) that each pair's mixing coefficient lam is drawn from.
        mu: The weight of the Mixup term added to next-token prediction.
        **kwargs: Trainer's keyword arguments (model, args, train_dataset, data_collator, ...).
    """

    def __init__(self, *args, confident: list[int], unconfident: list[int], alpha: float = ALPHA,
                 mu: float = MU, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.args.per_device_train_batch_size % 2:
            raise ValueError("SFTMix pairs samples: per_device_train_batch_size must be even")
        self.confident, self.unconfident = confident, unconfident
        if not alpha > 0:
            raise ValueError(f"SFTMix: alpha must be above 0, got {alpha}")
        self.alpha, self.mu = float(alpha), mu
        self._beta: torch.distributions.Beta | None = None  # on the hidden states' device: lam drawn there
        self.model_accepts_loss_kwargs = False

    def beta(self, device: torch.device) -> torch.distributions.Beta:
        """Beta(alpha, alpha) on device: each step's lam drawn there (a draw on the host, copied, waits for
        the device).

        Args:
            device: The hidden states' device.

        Returns:
            The distribution, its parameters on device (made once per device).
        """
        if self._beta is None or self._beta.concentration1.device != device:
            alpha = torch.tensor(self.alpha, device=device)
            self._beta = torch.distributions.Beta(alpha, alpha, validate_args=False)  # checked on the host
        return self._beta

    def get_train_dataloader(self) -> DataLoader:
        """Trainer's hook: batches of paired samples.

        Returns:
            A loader of per_device_train_batch_size / 2 confident then as many unconfident rows per
            batch (PairedBatchSampler, seeded by args.seed), prepared by the accelerator.
        """
        sampler = PairedBatchSampler(self.confident, self.unconfident, self.args.per_device_train_batch_size // 2,
                                     self.args.seed)
        loader = DataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=self.data_collator)
        return self.accelerator.prepare(loader)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's hook: NTP + mu * Mixup from one pass of the model (its logits at one position
        only: the head is applied where the losses need it).

        Args:
            model: The causal LM as Trainer passes it (wrapped by DDP or PEFT or not): called
                itself, so that a wrapper's forward runs (DDP's gradient sync), for the last hidden
                states; its output embeddings are the head.
            inputs: The batch: "input_ids", "attention_mask", "labels" (-100 outside the response),
                its first half confident, its second unconfident; "sample_index" where the rows carry it.
            return_outputs: Also return {"hidden": the last hidden states}.
            num_items_in_batch: Ignored: the losses are per-micro-batch token means.

        Returns:
            The scalar loss, or (loss, {"hidden": ...}) with return_outputs.
        """
        labels = inputs["labels"]
        index = {SAMPLE_INDEX: inputs[SAMPLE_INDEX]} if SAMPLE_INDEX in inputs else {}  # the monitor's, where it runs
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                    output_hidden_states=True, logits_to_keep=1, **index)
        hidden = out.hidden_states[-1]  # after the final norm: what the head reads
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        lam = self.beta(hidden.device).sample((len(labels) // 2,))
        loss = ntp_loss(hidden, labels, head) + self.mu * mixup_loss(hidden, labels, head, lam)
        return (loss, {"hidden": hidden}) if return_outputs else loss
