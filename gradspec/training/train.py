"""`gradspec train`: a small SFT run with transformers' Trainer, the loss of your choice (ntp, wit,
sftmix), the live spectral monitor and the training dynamics; saves the model and both files."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gradspec.choices import LOSSES, check_modules
from gradspec.data.errors import InputError, check_at_least, check_covers, check_writable
from gradspec.data.models import check_device, check_model
from gradspec.data.readers import Fields, Sample, data_samples
from gradspec.data.shared_options import (
    device_option,
    fields_option,
    limit_option,
    max_length_option,
    prompt_weight_option,
    response_weight_option,
    template_option,
)
from gradspec.data.templates import NO_RESPONSE, check_response_tokens, tokenize
from gradspec.files import place_folder, temporary, temporary_of
from gradspec.files.parts import SUFFIX as PARTS
from gradspec.options import OptionError, OptionExists, check_options, mention, nearest, option
from gradspec.output_options import out_option, overwrite_option, progress_option

if TYPE_CHECKING:
    from transformers import TrainingArguments

log = logging.getLogger("gradspec")

# what a run writes into --out: checkpoint-N stands for Trainer's checkpoints (--trainer-args save_steps=N)
OUTPUTS = ("model", "dynamics.parquet", "monitor.parquet", "checkpoint-N")
MODEL = OUTPUTS[0]
_RANK = re.compile(r"\.rank\d+(?=\.parquet$)")  # under torchrun each rank's monitor file: monitor.rank<r>.parquet
_STEP = re.compile(r"(?<=^checkpoint-)\d+$")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A small fine-tuning run; each field is an option (gradspec.options): the train command's flag,
    its --config key and a keyword of TrainConfig, checked where the config is made."""

    data: str | None = option(None, "training data, as for score (default: HumanEval)", kind="path?")
    model: str | None = option(None, "model folder (default: SmolLM2-135M-Instruct)", kind="path?")
    out: str = out_option("gradspec-train", "folder for model/, dynamics.parquet, monitor.parquet")
    overwrite: bool = overwrite_option("replace an earlier run's files in out")
    loss: str = option("ntp", "ntp (next-token prediction), wit (weighted instruction tuning) or sftmix",
                       choices=LOSSES)
    prompt_weight: float = prompt_weight_option()
    response_weight: float = response_weight_option()
    alpha: float | None = option(None, "SFTMix: Beta(alpha, alpha) for the Mixup weight (default 0.5)",
                                 kind="float?")
    mu: float | None = option(None, "SFTMix: weight of the Mixup term (default 0.2)", kind="float?", at_least=0)
    reference_dynamics: str | None = option(None, "SFTMix: dynamics file giving the confidence (default: "
                                            "perplexity under the starting model)", kind="path?")
    template: str = template_option()
    max_length: int = max_length_option()
    limit: int | None = limit_option("train on")
    epochs: float = option(1.0, "passes over the data", kind="float")
    max_steps: int = option(-1, "stop after this many steps (-1: run the epochs)", kind="int")
    batch_size: int = option(4, "samples per step", kind="int", at_least=1)
    learning_rate: float = option(2e-5, "AdamW's learning rate", kind="float")
    monitor_every: int = option(5, "spectra of the training batch every N steps (Trainer logs at them)", kind="int",
                                at_least=1)
    eval_data: str | None = option(None, "held-out rows (as --data) whose loss Trainer evaluates: at each epoch's "
                                   "end, or every eval_steps (--trainer-args eval_steps=N)", kind="path?")
    resume: str | None = option(None, "continue the run in out from its checkpoint: 'last' or a checkpoint folder "
                                "(checkpoints: --trainer-args save_steps=N)", kind="path?")
    trainer_args: dict | None = option(None, "more of transformers' TrainingArguments, passed on as given: "
                                       "gradient_accumulation_steps=4 bf16=true lr_scheduler_type=cosine "
                                       "warmup_steps=10 save_steps=50 ...", kind="pairs?")
    modules: str = option("attn", "modules the monitor scores (as for score)", kind="strs", convert=check_modules)
    seed: int = option(0, "seed of the data order and the model's initialisation", kind="int")
    device: str = device_option()
    fields: Fields = fields_option()
    progress: bool = progress_option()

    def __post_init__(self) -> None:
        check_options(self)


def check(config: TrainConfig) -> TrainingArguments:
    """Every option that can be checked before the model loads (types, choices and bounds were
    checked where the config was made); the run's TrainingArguments, which check trainer_args."""
    if config.max_steps != -1:
        check_at_least({"max_steps": config.max_steps})
    elif config.epochs <= 0:
        raise OptionError("epochs", f"must be above 0, got {config.epochs}")
    for name, value in (("learning_rate", config.learning_rate), ("alpha", config.alpha)):
        if value is not None and value <= 0:
            raise OptionError(name, f"must be above 0, got {value}")
    given = [name for name in ("alpha", "mu", "reference_dynamics") if getattr(config, name) is not None]
    if given and config.loss != "sftmix":
        raise OptionError(given, f": only for {mention('loss')} sftmix, not {config.loss}")
    if config.loss == "wit" and config.prompt_weight == 0 and config.response_weight == 0:
        raise OptionError(("prompt_weight", "response_weight"), "are both 0: nothing to learn from")
    if config.loss == "sftmix" and config.batch_size % 2:
        raise OptionError("batch_size", f"{config.batch_size}: SFTMix pairs a confident with an unconfident "
                          "sample; give an even batch size")
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise OptionError("out", f"{config.out} is a file; train writes a folder")
    if config.eval_data is not None and config.loss == "sftmix":
        raise OptionError("eval_data", f": SFTMix's loss pairs training samples; {mention('eval_data')} is for "
                          f"{mention('loss')} ntp and wit")
    args = training_arguments(config)  # each of trainer_args named where it is wrong, before the model loads
    if config.resume is not None:
        resumed_checkpoint(config)
    earlier = run_files(out)
    if earlier and not config.overwrite and config.resume is None:
        raise OptionExists("out", f"{config.out} holds {_earlier_run(out, earlier)}; pass {mention('overwrite')} "
                           f"to replace them or choose another {mention('out')}")
    check_writable(out, as_folder=True)
    check_device(config.device)
    check_model(config.model)
    if config.reference_dynamics is not None:
        from gradspec.training.dynamics import read_dynamics

        read_dynamics(config.reference_dynamics)
    return args


def train(config: TrainConfig) -> Path:
    """Runs the fine-tuning; returns the output folder (model, dynamics.parquet, monitor.parquet)."""
    args = check(config)  # before transformers' Trainer loads: a mistake is named at once
    from transformers import Trainer

    from gradspec.data.models import fit_to_context, load_model
    from gradspec.layers.targets import select_targets
    from gradspec.runs.distributed import bind_device
    from gradspec.training.checkpoint import named_load_errors, vet_checkpoint
    from gradspec.training.dynamics import DynamicsCallback
    from gradspec.training.monitor_callback import SpectralMonitorCallback
    from gradspec.training.sample_index import SAMPLE_INDEX
    from gradspec.training.sftmix import SFTMixTrainer, confidence_halves
    from gradspec.training.wit import WITCollator, WITLoss, use_wit_loss

    samples: list[Sample] = list(data_samples(config.data, config.fields, config.limit))
    if len(samples) < (2 if config.loss == "sftmix" else 1):
        raise InputError(f"{config.data or 'humaneval'}: {len(samples)} rows; "
                         + ("SFTMix pairs samples: it needs 2 or more" if samples else "nothing to train on"))
    if config.reference_dynamics is not None:
        from gradspec.training.dynamics import read_dynamics

        check_covers(read_dynamics(config.reference_dynamics)[0]["index"], [s.index for s in samples],
                     "reference_dynamics", config.reference_dynamics)
    # under torchrun each rank loads onto its own GPU (a bare cuda was GPU 0 for every rank until Trainer moved it)
    model, tokenizer = load_model(config.model, bind_device(config.device))
    max_length = fit_to_context(config.max_length, model)
    _check_labels(samples, tokenizer, config.template, max_length)
    select_targets(model, config.modules)  # the monitor's modules, named now if none matches: not at its first step
    rows = [{"messages": s.messages, SAMPLE_INDEX: s.index} for s in samples]  # monitor rows name their sample
    out = Path(config.out)
    prompt_weight = config.prompt_weight if config.loss == "wit" else 0.0
    collator = WITCollator(tokenizer, prompt_weight, config.template, max_length)
    callbacks = [
        SpectralMonitorCallback(config.monitor_every, config.modules, out / "monitor.parquet", overwrite=True),
        DynamicsCallback(tokenizer, samples, out / "dynamics.parquet", config.template, max_length),
    ]
    common = {"model": model, "args": args, "train_dataset": rows, "data_collator": collator, "callbacks": callbacks}
    if config.eval_data is not None:
        common["eval_dataset"] = [{"messages": s.messages} for s in data_samples(config.eval_data, config.fields)]
    if config.loss == "sftmix":
        confident, unconfident = confidence_halves(_reference(config, model, tokenizer, samples, max_length),
                                                   [s.index for s in samples])  # positions in rows
        mix = {k: v for k, v in (("alpha", config.alpha), ("mu", config.mu)) if v is not None}
        trainer = SFTMixTrainer(**common, confident=confident, unconfident=unconfident, **mix)
    else:
        if config.loss == "wit":
            use_wit_loss(model, WITLoss(config.prompt_weight, config.response_weight))
        trainer = Trainer(**common)
    checkpoint = None if config.resume is None else resumed_checkpoint(config)
    if checkpoint is not None:  # before Trainer reads a file of it
        vet_checkpoint(checkpoint, trainer, [s.index for s in samples])
    if config.overwrite and config.resume is None:  # an earlier run's files, partial ones too, gone first
        for path in run_files(out):
            if path.is_dir() and not path.is_symlink():  # a link is removed, not what it points to
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    with named_load_errors(trainer, checkpoint):
        trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    _save_model(trainer, tokenizer, out / MODEL)
    if callbacks[1].write_error is not None:  # the model is saved: now the file that was not is named
        raise OSError(f"{callbacks[1].out}: not written ({callbacks[1].write_error}); the model is saved in "
                      f"{out / MODEL}")
    return out


# TrainingArguments that gradspec train's own options give (their option), or that it must hold (None)
_OWNED = {"output_dir": "out", "per_device_train_batch_size": "batch_size", "num_train_epochs": "epochs",
          "max_steps": "max_steps", "learning_rate": "learning_rate", "seed": "seed", "logging_steps": "monitor_every",
          "use_cpu": "device", "resume_from_checkpoint": "resume", "disable_tqdm": "progress",
          "remove_unused_columns": None}


# TrainingArguments that would make the run another one than gradspec train's, and why
_REFUSED = {"label_smoothing_factor": "Trainer's label smoother replaces the model's loss, which WIT, SFTMix and the "
                                      "spectral monitor read (and clamps WIT's prompt labels to token 0)"}


def training_arguments(config: TrainConfig) -> TrainingArguments:
    """transformers' TrainingArguments of the run: its own options, then trainer_args as given (checked
    against TrainingArguments' fields; one that an option gives is named by that option); save_steps
    alone saves every save_steps, eval_data alone evaluates at each epoch's end (every eval_steps where
    given)."""
    import dataclasses

    from transformers import TrainingArguments

    extra = dict(config.trainer_args or {})
    fields = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    for key in extra:
        if key in _REFUSED:
            raise OptionError("trainer_args", f": {key}: {_REFUSED[key]}")
        if key in _OWNED:
            raise OptionError("trainer_args", f": {key} is " + (f"{mention(_OWNED[key])}'s" if _OWNED[key] else
                              "held False: the collator reads the rows' text") + " to give")
        if key not in fields:
            near = nearest(key, fields, edits=max(2, len(key) // 4))  # long names, longer misses
            raise OptionError("trainer_args", f": {key} is none of TrainingArguments' fields"
                              + (f" (did you mean {near}?)" if near else ""))
    if "save_steps" in extra:
        extra.setdefault("save_strategy", "steps")
    evaluated = {"eval_steps", "eval_strategy"} & set(extra)
    if config.eval_data is None and evaluated and extra.get("eval_strategy", "steps") != "no":
        raise OptionError("trainer_args", f": {sorted(evaluated)[0]} evaluates {mention('eval_data')}; give it")
    if config.eval_data is not None:
        extra.setdefault("eval_strategy", "steps" if "eval_steps" in extra else "epoch")
    arguments = {"output_dir": str(config.out), "per_device_train_batch_size": config.batch_size,
                 "num_train_epochs": config.epochs, "max_steps": config.max_steps,
                 "learning_rate": config.learning_rate, "remove_unused_columns": False, "report_to": [],
                 "save_strategy": "no", "logging_steps": config.monitor_every, "seed": config.seed,
                 "use_cpu": config.device == "cpu", "disable_tqdm": not config.progress, **extra}
    try:
        return TrainingArguments(**arguments)
    except (ValueError, TypeError) as e:  # TrainingArguments' own checks of a value
        raise OptionError("trainer_args", f": {' '.join(str(e).split())}") from None


def resumed_checkpoint(config: TrainConfig) -> Path:
    """The checkpoint folder a resumed run continues from: out's newest for 'last', else the one given."""
    if config.resume == "last":
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(config.out) if Path(config.out).is_dir() else None
        if last is None:
            raise OptionError("resume", f"last: {config.out} holds no checkpoint-N folder; a run saves them with "
                              f"{mention('trainer_args')} save_steps=N")
        return Path(last)
    path = Path(config.resume)
    if not (path / "trainer_state.json").is_file():
        raise OptionError("resume", f"{config.resume}: not a Trainer checkpoint (no trainer_state.json); give one "
                          f"of {config.out}'s checkpoint-N folders or 'last'")
    if path.resolve().parent != Path(config.out).resolve():  # the monitor's rows and the dynamics are out's
        raise OptionError("resume", f"{config.resume}: not one of {mention('out')} {config.out}'s checkpoints; a "
                          "run continues in the folder it was stopped in")
    return path


def _reference(config: TrainConfig, model, tokenizer, samples: list[Sample], max_length: int):
    """Per-sample mean perplexity over reference checkpoints: a dynamics file, or the start (each sample cut
    to max_length tokens, as it trains)."""
    from gradspec.training.dynamics import measure, read_dynamics, summarise

    if config.reference_dynamics is not None:
        return read_dynamics(config.reference_dynamics)[0]
    start = measure(model, tokenizer, samples, config.template, max_length)
    return summarise({"start": start})


def _check_labels(samples: list[Sample], tokenizer, template: str, max_length: int) -> None:
    """Stops before training when most samples have no response token (templates.check_response_tokens);
    otherwise says how many have none (they add no response loss; dynamics.parquet flags them)."""
    statuses = Counter(tokenize(s.messages, tokenizer, template, max_length).status for s in samples)
    check_response_tokens(statuses)
    missing = {s: n for s, n in statuses.items() if s in NO_RESPONSE}
    if missing:
        log.warning("%d of %d samples have no response tokens to train on (%s); dynamics.parquet flags them",
                    sum(missing.values()), len(samples), ", ".join(f"{s} {n}" for s, n in sorted(missing.items())))


def run_files(out: str | Path) -> list[Path]:
    """A run's files in its out folder: its OUTPUTS (under torchrun one monitor file per rank), then the
    partial ones a run killed while writing them left (_partial_of).

    Args:
        out: The run's out folder.

    Returns:
        The paths, outputs in OUTPUTS' order, then the partial ones; none where out is no folder.
    """
    out = Path(out)
    files = [p for p in out.iterdir() if _output_of(p.name) in OUTPUTS] if out.is_dir() else []
    return sorted(files, key=lambda p: (_partial_of(p.name) is not None, OUTPUTS.index(_output_of(p.name)), p.name))


def _partial_of(name: str) -> str | None:
    """The output a partial one in out is of (None: name is no partial output): the temporary a file or the
    model folder is written to beside it (files.temporary), left where a run was killed writing it; or the
    monitor's parts folder (compacted into its file at the training's end), left by a run killed before."""
    return temporary_of(name) or (name.removesuffix(PARTS) if name.endswith(PARTS) else None)


def _output_of(name: str) -> str:
    """The OUTPUTS name a file in out stands for (a rank's monitor file, a partial one: theirs)."""
    return _STEP.sub("N", _RANK.sub("", _partial_of(name) or name))


def _earlier_run(out: Path, files: list[Path]) -> str:
    """What an earlier run left, as the refusal names it: each file there, a partial one said to be, and
    whether that run finished (its model, saved last and whole, is there)."""
    names = [f"{p.name}{'/' if p.is_dir() else ''}{' (partial)' if _partial_of(p.name) else ''}" for p in files]
    finished = (out / MODEL).is_dir() and not any(_partial_of(p.name) for p in files)
    return ("an earlier run's " if finished else "what an earlier run left, stopped before it finished: ") + \
        ", ".join(names)


def _save_model(trainer, tokenizer, path: Path) -> None:
    """The trained model and its tokenizer at path, whole or not at all: written into a temporary folder
    beside it (files.temporary, named by the main process's pid on every rank), put in place once complete
    (files.place_folder: a resumed run's model, the stopped run's, replaced). A failed write (a full disk)
    leaves no path and an OSError naming it; the run's other outputs, written before, stay."""
    from safetensors import SafetensorError

    partial = temporary(path, _main_pid())
    try:
        trainer.save_model(str(partial))  # on every rank: a model sharded at load is gathered across them
        if trainer.args.should_save:
            tokenizer.save_pretrained(str(partial))
            place_folder(partial, path)
    except BaseException as error:
        if trainer.args.should_save:
            shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(error, (OSError, RuntimeError, SafetensorError)):  # what a failed write raises
            raise
        kept = [p.name for p in run_files(path.parent)]
        raise OSError(f"{path}: {getattr(error, 'strerror', None) or error}; the model is not saved"
                      + (f" ({', '.join(kept)} kept)" if kept else "")) from error


def _main_pid() -> int:
    """The pid of the process that saves the model (rank 0's under torch.distributed), the same on every
    rank: the ranks of a sharded model write their shares into one temporary folder."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return os.getpid()
    pid = [os.getpid()]
    dist.broadcast_object_list(pid, src=0)
    return pid[0]
