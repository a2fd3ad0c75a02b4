"""The options every command that reads training data takes, declared once (gradspec.options):
ScoreConfig and TrainConfig make their fields with these, and ``Reading`` holds them for the
commands that have no config of their own (diagnose, dynamics). WIT's token weights are declared here too:
train and validate --objectives wit take the same two options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradspec.choices import MAX_LENGTH
from gradspec.data.readers import Fields
from gradspec.data.templates import TEMPLATES
from gradspec.options import check_options, option


def template_option() -> Any:
    return option("plain", "how a row becomes text: plain, or the tokenizer's chat template", choices=TEMPLATES)


def max_length_option() -> Any:
    return option(MAX_LENGTH, "tokens per sample at most, and never more than the model's context (longer samples "
                  "are cut, and flagged)", kind="int", at_least=1)


def limit_option(verb: str) -> Any:
    return option(None, f"{verb} only the first N samples", kind="int?", at_least=1)


def prompt_weight_option() -> Any:
    return option(0.3, "WIT's weight of prompt tokens (the paper's recommended region)", kind="float", at_least=0)


def response_weight_option() -> Any:
    return option(1.0, "WIT's weight of response tokens", kind="float", at_least=0)


def device_option() -> Any:
    return option("cpu", "cpu or cuda[:i]", kind="device")


def fields_option() -> Any:
    return option(Fields(), "which of the input's columns holds what", group=True)


@dataclass(frozen=True, kw_only=True)
class Reading:
    """How a command reads its training data and where its models run.

    Args:
        template: how a row becomes text (data.templates.TEMPLATES).
        max_length: tokens per sample at most.
        limit: read only the first N samples (None: all).
        device: where the models run.
        fields: which of the input's columns holds what.
    """

    template: str = template_option()
    max_length: int = max_length_option()
    limit: int | None = limit_option("read")
    device: str = device_option()
    fields: Fields = fields_option()

    def __post_init__(self) -> None:
        check_options(self)
