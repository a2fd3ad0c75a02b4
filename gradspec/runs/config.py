"""A scoring run's config (ScoreConfig: everything that decides its output), the checks of its
fields' types where it is made, and of every option before the model loads."""

from __future__ import annotations

import dataclasses
import numbers
import os
import reprlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from gradspec.align.task import DEFAULT_AGGREGATES
from gradspec.data.errors import check_at_least
from gradspec.data.hub import is_dataset_name
from gradspec.data.models import DEFAULT_MODEL, check_device, check_device_map, check_model
from gradspec.data.readers import (
    HUMANEVAL_SIZE,
    Fields,
    Hub,
    InputError,
    Sample,
    SampleStream,
    count_records,
    data_samples,
    mixed_columns_of,
    with_text_columns,
)
from gradspec.runs.run_folder import CHUNK_ROWS
from gradspec.runs.score_files import METADATA_KEY

# What each ScoreConfig field takes (typed's kinds; "?": or None); fields and hub are checked apart
_FIELD_KINDS = {
    "data": "path?", "model": "path?", "template": "str", "modules": "strs", "max_length": "int", "dtype": "str",
    "method": "str", "rank": "int", "seed": "int", "classic": "bool", "save_spectra": "bool", "limit": "int?",
    "chunk_rows": "int", "precision": "str", "task": "path?", "aggregate": "strs", "spectra": "bool", "project": "int",
}
_KIND_WORDS = {"int": "an int", "bool": "a bool", "str": "a str", "strs": "a str or a list of str",
               "path": "a str or a pathlib.Path", "device": "a str or a torch.device"}


def typed(name: str, value: Any, kind: str) -> Any:
    """value, if it is of kind (_KIND_WORDS; with "?" after it, None too), in the form a run keeps: an
    integral number (not a bool) as an int, a path as a str, a list of str joined by commas, a
    torch.device as its name; else a TypeError that names the parameter as Python code passes it."""
    optional, kind = kind.endswith("?"), kind.rstrip("?")
    if value is None and optional:
        return None
    if kind == "int" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind != "int" and kind != "bool" and isinstance(value, str):
        return value
    if kind == "path" and isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return os.fspath(value)
    if kind == "strs" and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if kind == "device" and isinstance(value, torch.device):
        return str(value)
    raise TypeError(f"{name} must be {_KIND_WORDS[kind]}{' or None' if optional else ''}, got "
                    f"{type(value).__name__} {reprlib.repr(value)}")


def _fields(value: Any) -> Fields:
    """fields as a Fields: one, or a dict of Fields' names (instruction, input, output, messages,
    conversations) to the input's column names, the others left at their defaults; that is how a
    run's manifest writes them, and what a dict of "which column holds what" means."""
    names = [f.name for f in dataclasses.fields(Fields)]
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise TypeError(f"fields has no name {unknown[0]!r}: a dict's keys are Fields' names ({', '.join(names)}) "
                            f"and its values the input's column names, e.g. fields={{'instruction': 'prompt'}}")
        return Fields(**{k: typed(f"fields[{k!r}]", v, "str") for k, v in value.items()})
    if not isinstance(value, Fields):
        raise TypeError(f"fields must be a gradspec.Fields or a dict of its names to column names, got "
                        f"{type(value).__name__} {reprlib.repr(value)}")
    for name in names:
        typed(f"fields.{name}", getattr(value, name), "str")
    return value


def _hub(value: Any) -> Hub:
    """hub as a Hub (a dict of its fields too, as a manifest writes it), each field of its type."""
    if isinstance(value, Mapping):
        value = Hub(**value)
    if not isinstance(value, Hub):
        raise TypeError(f"hub must be a Hub, got {type(value).__name__} {reprlib.repr(value)}")
    for name, kind in (("split", "str"), ("name", "str?"), ("streaming", "bool")):
        typed(f"hub.{name}", getattr(value, name), kind)
    return value


@dataclass(frozen=True)
class ScoreConfig:
    """Everything that decides a run's output; a run resumes only under the same config."""

    data: str | None = None  # None: HumanEval
    model: str | None = None  # None: SmolLM2-135M-Instruct
    template: str = "plain"
    modules: str = "attn"
    max_length: int = 2048
    dtype: str = "float32"
    method: str = "exact"
    rank: int = 64
    seed: int = 0
    classic: bool = False
    save_spectra: bool = False
    fields: Fields = Fields()
    limit: int | None = None
    chunk_rows: int = CHUNK_ROWS
    precision: str = "fp64"  # of the Grams and sketch products (gradspec.linalg.policy)
    task: str | None = None  # a task file: add the cosines of each sample's gradient with its examples'
    aggregate: str = ",".join(DEFAULT_AGGREGATES)
    spectra: bool = True
    project: int = 0  # k: store each sample's gradient under a k x k Kronecker projection per part
    hub: Hub = Hub()  # the split, configuration and streaming of data read through `datasets`

    def __post_init__(self) -> None:
        """Every field checked for its type where the config is made, so that a wrong one (say
        max_length="64") is named, not met deep inside the run; kept in plain form (typed: a path
        as a str, a list of modules joined by commas), fields and hub given as dicts made theirs."""
        for name, kind in _FIELD_KINDS.items():
            object.__setattr__(self, name, typed(name, getattr(self, name), kind))
        object.__setattr__(self, "fields", _fields(self.fields))
        object.__setattr__(self, "hub", _hub(self.hub))

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
        if self.task is None:  # a spectra run describes itself as before alignment existed
            del info["task"], info["aggregate"]
        if self.task is None and not self.project:
            del info["spectra"]
        return info

    @classmethod
    def from_manifest(cls, info: dict[str, Any]) -> ScoreConfig:
        """The config a run was started with, from its manifest or its score file's metadata
        (describe's output; what describe leaves out takes its default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        options = {k: v for k, v in info.items() if k in names}
        options["data"] = None if info.get("data") == "humaneval" else info.get("data")
        options["model"] = None if info.get("model") == DEFAULT_MODEL else info.get("model")
        options["fields"] = Fields(**info.get("fields", {}))
        options["hub"] = Hub(**info.get("hub", {}))
        return cls(**options)

    def check(self) -> None:
        """Every option that can be checked before the model loads: a clear error for each."""
        check_at_least({"--max-length": self.max_length, "--chunk-rows": self.chunk_rows, "--rank": self.rank,
                        "--limit": self.limit})
        check_at_least({"--k": self.project}, 0)
        if not self.spectra and self.task is None and not self.project:
            raise ValueError("nothing to compute: spectra are off, and neither a task file nor a projection is given")
        if self.hub != Hub() and self.data is not None and Path(self.data).is_file():
            raise ValueError(f"--split, --config-name and --streaming apply to data read through datasets (a Hub "
                             f"name or a folder); {self.data} is a file")
        for flag, path in (("--data", self.data), ("--target", self.task)):
            if path is not None and not Path(path).exists() and not is_dataset_name(path):
                raise InputError(f"{flag} {path}: no such file or folder (nor a Hub dataset name: org/name)")
            if path is not None and Path(path).suffix == ".parquet" and Path(path).is_file() and \
                    METADATA_KEY in (pq.read_schema(path).metadata or {}):
                raise InputError(f"{flag} {path}: a file gradspec wrote (scores, a store), not training data; "
                                 "pass the data it scored")
        check_model(self.model)

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

    def samples(self, wanted: Callable[[int], bool] | None = None, on_error: str = "fail") -> SampleStream:
        """The rows wanted, in order, each carried column typed as in the whole input (a column whose
        values mix kinds, as text: readers.mixed_columns_of), and the input's head (SampleStream)."""
        def stream() -> Iterator[Sample]:
            text = mixed_columns_of(self.data, self.fields, self.limit, self.hub)  # read at the first row
            for sample in data_samples(self.data, self.fields, self.limit, wanted, on_error, self.hub):
                yield with_text_columns(sample, text)

        def head(n: int) -> Iterator[Sample]:
            limit = n if self.limit is None else min(n, self.limit)
            return data_samples(self.data, self.fields, limit, on_error="skip", hub=self.hub)

        return SampleStream(stream(), head)


def check_settings(config: ScoreConfig, device: str, batch_tokens: int | None, device_map: str | None = None) -> None:
    """Every check before the model loads: the config's (ScoreConfig.check), then the device's and the batch size's."""
    config.check()
    check_device_map(device_map, device)
    check_device(device)
    if batch_tokens is not None:
        check_at_least({"--batch-tokens": batch_tokens})
