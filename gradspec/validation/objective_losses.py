"""The losses of validate's objectives retrains, as Retrainer takes them (retrain.Objective: which rows each
step trains on, and the batch's loss). The math is gradspec train's (gradspec.training.wit, .sftmix); what is
validate's own is how samples are weighted in a batch: each sample's loss is a mean over its own tokens and
the batch's loss the mean of those, as in the NTP retrains (gradspec's response loss), so that an
objective's gain over NTP measures the recipe, not a reweighting of long and short samples. (gradspec
train's losses are Trainer's token means over the batch; for equal lengths the two agree.)

- WIT: each sample's wit_loss (its weighted prompt and response tokens over its own weighted count), with
  ValidateConfig's prompt_weight and response_weight; (0, 1) is the NTP retrain's loss.
- SFTMix: NTP (the retrains' loss) + MU * the Mixup term (sftmix.mixup_loss, lam ~ Beta(ALPHA, ALPHA) per
  pair), on batches of PairedBatchSampler (batch_size / 2 confident rows, then as many unconfident, paired
  in order). validate has no training dynamics: the confidence is -perplexity under the start model,
  measured once over the pool (gradspec train's default reference without --reference-dynamics).
"""

from __future__ import annotations

import pandas as pd
import torch

from gradspec.data.batching import BATCH_TOKENS, Item
from gradspec.data.sample import Sample
from gradspec.data.templates import IGNORE_INDEX, Tokenized
from gradspec.engine.loss import response_loss_per_sample
from gradspec.training.dynamics import measure_tokens, summarise
from gradspec.training.sftmix import ALPHA, MU, PairedBatchSampler, confidence_halves, mixup_loss
from gradspec.training.wit import check_weights, encode_labels, wit_loss
from gradspec.validation.retrain import Recipe, batches


class WIT:
    """Weighted instruction tuning: each sample's prompt tokens weighted prompt_weight, its response tokens
    response_weight (gradspec.training.wit.wit_loss of the sample alone), the mean over the batch. The data
    order is the NTP retrain's of the same seed."""

    def __init__(self, prompt_weight: float, response_weight: float) -> None:
        check_weights(prompt_weight, response_weight)
        self.prompt_weight, self.response_weight = prompt_weight, response_weight

    def batches(self, members: list[int], recipe: Recipe, seed: int) -> list[list[int]]:
        return batches(members, recipe, seed)

    def loss(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        wit = encode_labels(input_ids, labels != IGNORE_INDEX, attention_mask, self.prompt_weight,
                            self.response_weight)
        return torch.stack([wit_loss(logits[k:k + 1], wit[k:k + 1], self.prompt_weight, self.response_weight)
                            for k in range(len(labels))]).mean()


class SFTMix:
    """SFTMix with one reference checkpoint, the start. perplexity: per row index (index, mean_perplexity,
    as a dynamics file's), which sets the confident and unconfident halves of each retrain's rows."""

    def __init__(self, perplexity: pd.DataFrame, alpha: float = ALPHA, mu: float = MU) -> None:
        self.perplexity, self.alpha, self.mu = perplexity, alpha, mu

    @classmethod
    def at_start(cls, model: torch.nn.Module, tokenizer, rows: dict[int, Tokenized],
                 batch_tokens: int = BATCH_TOKENS) -> SFTMix:
        """The objective with each row's response perplexity under model as it is now (the start weights):
        the measures and the summary gradspec train takes for its default reference."""
        items = [Item(Sample(i, []), tokens) for i, tokens in rows.items()]
        return cls(summarise({"start": measure_tokens(model, tokenizer, items, batch_tokens)}))

    def batches(self, members: list[int], recipe: Recipe, seed: int) -> list[list[int]]:
        """Paired batches (PairedBatchSampler seeded by seed, pairs = batch_size / 2) of the members' two
        halves, epoch after epoch, for the steps of an NTP retrain of the same members: the same number of
        steps and learning-rate schedule. An odd count of members puts the middle row in the unconfident
        half; the smaller half is then drawn again within an epoch (as gradspec train does)."""
        confident, unconfident = confidence_halves(self.perplexity, members)  # positions in members
        sampler = PairedBatchSampler(confident, unconfident, recipe.batch_size // 2, seed)
        steps, out = recipe.steps(len(members)), []
        while len(out) < steps:
            out += [[members[p] for p in batch] for batch in sampler]
        return out[:steps]

    def loss(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
        """NTP + mu * Mixup on the batch (its first half confident, its second unconfident), from one pass:
        both read the last hidden states, the LM head's input."""
        return self.ntp_and_mixup(model, input_ids, attention_mask, labels, self.lam(len(labels) // 2))

    def lam(self, pairs: int) -> torch.Tensor:
        """Each pair's mixing weight, drawn from Beta(alpha, alpha) with torch's random state (the retrain's
        seed)."""
        alpha = torch.tensor(float(self.alpha))
        return torch.distributions.Beta(alpha, alpha).sample((pairs,))

    def ntp_and_mixup(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      labels: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """The loss for given mixing weights lam (one per pair)."""
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state
        head = model.get_output_embeddings()
        labels = labels.to(hidden.device)
        ntp = response_loss_per_sample(head(hidden), labels)[0].mean()
        return ntp + self.mu * mixup_loss(hidden, labels, head, lam.to(hidden.device))

