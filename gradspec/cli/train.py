"""`gradspec train`: a small SFT run with the loss of your choice, the spectral monitor and dynamics."""

from __future__ import annotations

import argparse

from gradspec.cli.given import refuse_unused
from gradspec.cli.score import add_field_arguments, fields_of
from gradspec.data.templates import TEMPLATES
from gradspec.training.train import LOSSES, TrainConfig


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="small SFT run with --loss ntp|wit|sftmix, the spectral monitor and dynamics")
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", help="training data, as for score (default: HumanEval)")
    p.add_argument("--out", default=TrainConfig.out, help="folder for model/, dynamics.parquet, monitor.parquet")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in --out")
    p.add_argument("--loss", choices=LOSSES, default=TrainConfig.loss)
    p.add_argument("--prompt-weight", type=float, default=TrainConfig.prompt_weight,
                   help="WIT's weight of prompt tokens")
    p.add_argument("--response-weight", type=float, default=TrainConfig.response_weight,
                   help="WIT's weight of response tokens")
    p.add_argument("--alpha", type=float, help="SFTMix: Beta(alpha, alpha) for the Mixup weight (default 0.5)")
    p.add_argument("--mu", type=float, help="SFTMix: weight of the Mixup term (default 0.2)")
    p.add_argument("--reference-dynamics", help="SFTMix: dynamics file giving the confidence "
                                                 "(default: perplexity under the starting model)")
    p.add_argument("--template", choices=TEMPLATES, default=TrainConfig.template)
    p.add_argument("--max-length", type=int, default=TrainConfig.max_length)
    p.add_argument("--limit", type=int, help="train on the first N samples")
    p.add_argument("--epochs", type=float, default=TrainConfig.epochs)
    p.add_argument("--max-steps", type=int, default=TrainConfig.max_steps,
                   help="stop after this many steps (default: -1, run the epochs)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--learning-rate", type=float, default=TrainConfig.learning_rate)
    p.add_argument("--monitor-every", type=int, default=TrainConfig.monitor_every,
                   help="spectra of the training batch every N steps")
    p.add_argument("--modules", default=TrainConfig.modules, help="modules the monitor scores (as for score)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--device", default=TrainConfig.device)
    add_field_arguments(p)


def run(args: argparse.Namespace) -> int:
    from gradspec.training.train import train

    refuse_unused(args, ("prompt_weight", "response_weight"), args.loss == "wit", "without --loss wit")
    fields = fields_of(args)
    options = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    out = train(TrainConfig(**options, fields=fields))
    print(f"wrote {out / 'model'}, {out / 'dynamics.parquet'} and {out / 'monitor.parquet'}")
    return 0
