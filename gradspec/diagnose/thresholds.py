"""What counts as unlearned, and which evidence points to which cause: the thresholds of
`gradspec diagnose`, declared as options (its flags), in a module of their own so that the command
line reads them without loading the models' libraries."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradspec.options import check_options, option, share

CRITERIA = ("reproduction", "likelihood")
JS_MAX = math.log(2)  # the Jensen-Shannon divergence's largest value in nats (two laws with no token in common)


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """What counts as unlearned, and which evidence points to which cause (docs/diagnose.md). Each
    field is an option (gradspec.options): a flag of `gradspec diagnose` and a keyword here."""

    distractors: int = option(3, "K: responses of similar prompts the gold one is tested against", kind="int",
                              at_least=1)
    repetitions: int = option(5, "R: draws of distractors, and sampled continuations", kind="int", at_least=1)
    criterion: str = option("reproduction", "unlearned: no continuation reproduces the response (reproduction), "
                            "or the gold response loses every draw (likelihood)", choices=CRITERIA)
    reproduced_rouge: float = share(0.7, "token ROUGE-L a continuation must reach to reproduce the response")
    pool: int = option(8, "distractors are drawn from this many most similar prompts", kind="int", at_least=1)
    learned_accuracy: float = share(0.9, "teacher-forced token accuracy that counts as learned (forgetting: "
                                    "learned at a checkpoint, below it now)")
    near_duplicate: float = share(0.95, "token ROUGE-L between prompts that makes them near-duplicates")
    divergent_rouge: float = share(0.5, "near-duplicates whose responses' ROUGE-L is below this diverge "
                                   "(inconsistent data)")
    familiar_margin: float = option(0.25, "a prompt is familiar to the base model when its perplexity is within "
                                    "this share of the best-known quarter's", kind="float", at_least=0)
    conflict_confidence: float = share(0.5, "the base model's probability on a wrong token that counts as "
                                       "confident disagreement")
    conflict_share: float = share(0.3, "share of the response's tokens with confident disagreement for a "
                                  "conflict with pre-training")
    js_threshold: float = option(0.1, "Jensen-Shannon divergence (nats) between the base and fine-tuned "
                                 "next-token laws for a conflict", kind="float", at_least=0, at_most=JS_MAX)
    missing_probability: float = share(0.3, "mean token probability of the response below which an unfamiliar "
                                       "prompt's knowledge is missing")
    rare_count: int = option(2, "a response token seen at most this often in all responses is rare", kind="int",
                             at_least=0)
    falling_loss: float = option(0.05, "relative drop of perplexity from the last checkpoint to the final model "
                                 "that counts as still falling", kind="float", at_least=0)
    seed: int = option(0, "seed of the distractor draws and the sampled continuations", kind="int")

    def __post_init__(self) -> None:
        check_options(self)
