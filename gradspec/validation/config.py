"""validate's options, declared once (gradspec.options): what the retrains compute (ValidateConfig, the
run's manifest: a resume continues only the same one) and how the command runs and analyses them
(ValidateSettings)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import reprlib
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from gradspec.choices import DEFAULT_MODEL, LOSSES
from gradspec.data.errors import check_at_least
from gradspec.data.hub import is_dataset_name
from gradspec.data.readers import Fields
from gradspec.data.shared_options import (
    device_option,
    fields_option,
    limit_option,
    max_length_option,
    prompt_weight_option,
    response_weight_option,
    template_option,
)
from gradspec.errors import OptionInputError
from gradspec.files import NotRegularFile, regular, sha256
from gradspec.options import OptionError, check_options, mention, nearest, option, share, typed
from gradspec.output_options import out_option, overwrite_option, progress_option
from gradspec.validation.lm_eval_metric import is_lm_eval, lm_eval_metric
from gradspec.validation.scores import split_spec

SPEC = "FILE[:COLUMN]"  # a score spec, as --help names it
NTP = LOSSES[0]  # the objectives' baseline: plain next-token training, the retrains' own loss
OBJECTIVES = LOSSES[1:]  # --objectives' choices: gradspec train's other losses


def _specs(name: str, value: Any) -> tuple[str, ...]:
    """Score specs (FILE[:COLUMN]) as a tuple: a column may be a select --by combination, commas and all,
    so a list is never joined into one string."""
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    return tuple(typed(name, v, "path") for v in value)


def _objectives(name: str, value: Any) -> tuple[str, ...]:
    """--objectives' names as a tuple in OBJECTIVES' order (each once: the same retrains whatever order they
    are given in), each one of OBJECTIVES."""
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(v, str) for v in names):
        raise TypeError(f"{name} must be a str or a list of str, got {type(value).__name__} {reprlib.repr(value)}")
    for given in names:
        if given not in OBJECTIVES:
            near = nearest(given, OBJECTIVES)
            raise OptionError(name, f"{given!r}: not an objective; choose from {', '.join(OBJECTIVES)}"
                              + (f" (did you mean {near}?)" if near else "")
                              + (" (plain next-token training, the baseline, is always retrained)"
                                 if given == NTP else ""))
    return tuple(n for n in OBJECTIVES if n in names)


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    """What the retrains are: the pool, the targets, the recipe, the subsets and the selections. Recorded
    in the run's manifest and its file; a resume or a joining shard must have the same."""

    data: str | None = option(None, "the training pool, as for score (default: HumanEval)", kind="path?")
    target: str | None = option(None, "examples of the task whose loss the retrains measure (same formats and "
                                "fields as data); required", kind="path?")
    model: str | None = option(None, "model folder: every retrain starts from its weights (default: "
                               "SmolLM2-135M-Instruct)", kind="path?")
    template: str = template_option()
    max_length: int = max_length_option()
    limit: int | None = limit_option("train on")
    subsets: int = option(16, "LDS: retrains on random subsets of the pool (0: none)", kind="int", at_least=0)
    fraction: float = share(0.5, "LDS: each subset's share of the pool")
    outcome: tuple[str, ...] = option((), "selection outcome: score specs FILE[:COLUMN] whose top --top of the "
                                      "pool is retrained on, beside random and length", kind="strs", convert=_specs,
                                      many=True, metavar=SPEC)
    top: float = share(0.25, "selection outcome: the share of the pool each selection keeps")
    seeds: int = option(3, "selection outcome, removal test and objectives: retrains per selection, removal or "
                        "objective, each with its own seed", kind="int", at_least=1)
    length_buckets: int = option(5, "selection outcome: also each score's selection shared out over this many "
                                 "length buckets (0: not)", kind="int", at_least=0)
    removal: tuple[str, ...] = option((), "removal test: score specs FILE[:COLUMN] whose top and whose bottom "
                                      "--remove of the pool are left out of a retrain, beside random rows",
                                      kind="strs", convert=_specs, many=True, metavar=SPEC)
    remove: float = share(0.1, "removal test: the share of the pool each removal leaves out")
    objectives: tuple[str, ...] = option((), f"training objectives retrained on the whole pool beside plain "
                                         f"next-token training (ntp), --seeds times each: {', '.join(OBJECTIVES)}",
                                         kind="strs", convert=_objectives, many=True, metavar="NAME")
    prompt_weight: float = prompt_weight_option()
    response_weight: float = response_weight_option()
    epochs: float = option(1.0, "passes over the retrain's rows", kind="float")
    max_steps: int = option(-1, "stop each retrain after this many steps (-1: run the epochs)", kind="int")
    batch_size: int = option(4, "samples per step", kind="int", at_least=1)
    learning_rate: float = option(2e-5, "AdamW's learning rate (linear decay to 0, as gradspec train)", kind="float")
    lora_rank: int | None = option(None, "train LoRA adapters of this rank on every linear layer (needs peft) "
                                   "instead of the full weights", kind="int?", at_least=1)
    seed: int = option(0, "seed of the subsets, the random selections and the data order", kind="int")
    metric: str | None = option(None, "module:function called as function(model, tokenizer) -> float after "
                                "each retrain (higher is better), or lm-eval:TASK[:METRIC] (a task name or YAML "
                                "file; needs lm-eval)", kind="str?")
    metric_limit: int | None = option(None, "lm-eval metric: evaluate on the task's first N documents", kind="int?",
                                      at_least=1)
    fields: Fields = fields_option()

    def __post_init__(self) -> None:
        check_options(self)

    def describe(self) -> dict[str, Any]:
        """The manifest: the config, the input files resolved with their sizes, the outcome's score files'
        hashes (a selection is only as fixed as the file it is read from) and the version."""
        info = {**asdict(self), "model": self.model or DEFAULT_MODEL, "data": self.data or "humaneval",
                "version": version("gradspec"), "chunk_rows": 1}
        for key in ("data", "target"):
            path = getattr(self, key)
            if path is not None and Path(path).exists():
                info[key] = str(Path(path).resolve())
                info[f"{key}_bytes"] = Path(path).stat().st_size if Path(path).is_file() else None
        info["outcome_files"] = {spec: _sha256(split_spec(spec)[0]) for spec in self.outcome}
        info["removal_files"] = {spec: _sha256(split_spec(spec)[0]) for spec in self.removal}
        for name, companions in ADDS_RETRAINS.items():
            if not getattr(self, name):  # adds none: recorded as a run made before it existed was
                for key in (name, *companions):
                    info.pop(key)
        return info


# The options that add retrains of their own after the others, with the keys that only they use: left out
# of the manifest where they add none, so that a run started before they existed resumes (its plan and
# its retrains are the same).
ADDS_RETRAINS = {"removal": ("remove", "removal_files"), "objectives": ("prompt_weight", "response_weight")}


@dataclass(frozen=True, kw_only=True)
class ValidateSettings:
    """How the command runs and what it does with the retrains; none changes a retrain."""

    out: str = out_option("validate.parquet", "the retrains' Parquet file (one row per retrain)")
    scores: tuple[str, ...] = option((), "score specs FILE[:COLUMN] to test: an attribution matrix (align "
                                     "--attribution) or a per-sample column or select --by expression",
                                     kind="strs", convert=_specs, many=True, metavar=SPEC)
    runs: tuple[str, ...] = option((), "analyse these retrain files instead of retraining", kind="strs",
                                   convert=_specs, many=True, metavar="RETRAINS")
    report: str | None = option(None, "folder for report.md, its figures and tables", kind="path?")
    resamples: int = option(1000, "bootstrap resamples of the intervals", kind="int", at_least=10)
    confidence: float = option(0.95, "the intervals' confidence", kind="float", at_least=0.5, at_most=0.999)
    device: str = device_option()
    resume: bool = option(False, "continue an interrupted run of the same config", kind="bool")
    overwrite: bool = overwrite_option("replace the output file (and an unfinished run of it), and the report")
    progress: bool = progress_option()

    def __post_init__(self) -> None:
        check_options(self)


def check(config: ValidateConfig, settings: ValidateSettings) -> Callable[[Any, Any], float] | None:
    """Every option that can be checked before the model loads. Returns the task metric's callable (None
    without --metric), built once here: an lm-eval metric's task set up is the costly part."""
    if settings.resume and settings.overwrite:
        raise OptionError(("resume", "overwrite"), ": the first continues a run, the second starts it again; pass "
                          "one of them")
    if config.target is None:
        raise OptionError("target", "is required: the examples whose loss each retrain measures")
    if config.subsets == 0 and not config.outcome and not config.removal and not config.objectives:
        raise OptionError(("subsets", "outcome", "removal", "objectives"), ": nothing to retrain (no subsets, no "
                          "selection outcome, no removal test, no objectives)")
    if "wit" in config.objectives and config.prompt_weight == 0 and config.response_weight == 0:
        raise OptionError(("prompt_weight", "response_weight"), "are both 0: WIT would learn from nothing")
    if "sftmix" in config.objectives and config.batch_size % 2:
        raise OptionError("batch_size", f"{config.batch_size}: SFTMix pairs a confident with an unconfident "
                          f"sample in each batch; give an even batch size (every retrain of the run takes it)")
    if config.subsets and not 0 < config.fraction < 1:
        raise OptionError("fraction", f"must be between 0 and 1 (not either), got {config.fraction}")
    if config.outcome and not 0 < config.top < 1:
        raise OptionError("top", f"must be between 0 and 1 (not either), got {config.top}")
    if config.removal and not 0 < config.remove < 1:
        raise OptionError("remove", f"must be between 0 and 1 (not either), got {config.remove}")
    if config.max_steps != -1:
        check_at_least({"max_steps": config.max_steps})
    elif config.epochs <= 0:
        raise OptionError("epochs", f"must be above 0, got {config.epochs}")
    if config.learning_rate <= 0:
        raise OptionError("learning_rate", f"must be above 0, got {config.learning_rate}")
    for name, path in (("data", config.data), ("target", config.target)):
        if path is not None and not Path(path).exists() and not is_dataset_name(path):
            raise OptionError(name, f"{path}: no such file or folder (nor a Hub dataset name: org/name)")
    for name, specs in (("outcome", config.outcome), ("removal", config.removal), ("scores", settings.scores)):
        for spec in specs:
            _score_file(name, spec)
    if config.lora_rank is not None and importlib.util.find_spec("peft") is None:
        raise OptionError("lora_rank", "trains LoRA adapters with peft, which is not installed: pip install peft, "
                          f"or leave {mention('lora_rank')} out to train the full weights")
    if config.metric_limit is not None and not is_lm_eval(config.metric or ""):
        raise OptionError("metric_limit", f"applies to an lm-eval metric ({mention('metric')} lm-eval:TASK)")
    metric = metric_function(config.metric, config.metric_limit) if config.metric is not None else None
    from gradspec.data.models import check_device, check_model  # here: torch loads only for a retrain

    check_device(settings.device)
    check_model(config.model)
    return metric


def _score_file(option: str, spec: str) -> None:
    """A score spec's file checked before any retrain: there, and a regular file (a FIFO would block the
    read that comes after hours of retraining)."""
    try:
        regular(split_spec(spec)[0], "pass a score file")
    except FileNotFoundError:
        raise OptionError(option, f"{spec}: no such score file") from None
    except NotRegularFile as e:
        raise OptionInputError(option, f"{spec}: {str(e).partition(': ')[2]}") from None


def metric_function(spec: str, limit: int | None = None) -> Callable[[Any, Any], float]:
    """The callable 'module:function' names (the current folder importable, as for python -m), or
    lm-eval's task metric for 'lm-eval:TASK[:METRIC]' (on its first limit documents)."""
    if is_lm_eval(spec):
        return _checked_calls(spec, lm_eval_metric(spec, limit))
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise OptionError("metric", f"{spec!r}: expected module:function, e.g. my_eval:accuracy")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OptionError("metric", f"{spec}: cannot be imported ({e})") from None
    if not callable(found):
        raise OptionError("metric", f"{spec}: not a function")
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # a builtin that does not say: its calls are checked
        signature = None
    if signature is not None:
        try:
            signature.bind(None, None)
        except TypeError:
            raise OptionError("metric", f"{spec}: takes {signature}, but {METRIC_CALL}") from None
    return _checked_calls(spec, found)


METRIC_CALL = "validate calls it as function(model, tokenizer) after each retrain and expects a number back"
_KEPT = " (the retrains finished before are kept: once it is fixed, the same command with --resume continues)"


def _checked_calls(spec: str, function: Callable[[Any, Any], Any]) -> Callable[[Any, Any], float]:
    """function, each call of it checked: an exception, or a value that is not a finite number (a bool is
    not one), stops validate with one line naming --metric; the retrains written before it stay."""
    def metric(model, tokenizer) -> float:
        try:
            value = function(model, tokenizer)
        except OptionError:
            raise
        except Exception as e:
            raise OptionError("metric", f"{spec}: raised {type(e).__name__}: {' '.join(str(e).split())}{_KEPT}") from e
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a NumPy or torch scalar
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            shown = " ".join(reprlib.repr(value).split())
            raise OptionError("metric", f"{spec}: returned {shown} ({type(value).__name__}), not a number; "
                              f"{METRIC_CALL}{_KEPT}")
        if not math.isfinite(value):
            raise OptionError("metric", f"{spec}: returned {value}, not a finite number{_KEPT}")
        return float(value)

    return metric


def _sha256(path: str) -> str | None:
    try:
        return sha256(path)[:16]
    except OSError:
        return None
