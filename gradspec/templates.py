"""Turning chat messages into token ids and a response-only label mask.

``plain`` reproduces the reference: text = the turns' contents joined by "\\n"; an assistant
turn starts at the token count of the tokenized text before it. ``chat`` uses the
tokenizer's chat template; an assistant turn starts after the generation prompt of the
turns before it and ends after its closing tokens. Both truncate on the right.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import IGNORE_INDEX

TEMPLATES = ("plain", "chat")


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]
    status: str  # "ok", "empty_prompt" (scored), "empty_response" or "prompt_too_long" (not scored)

    @property
    def scorable(self) -> bool:
        return self.status in ("ok", "empty_prompt")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_response_tokens(self) -> int:
        """Labelled tokens that have a preceding token to predict them from."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


def _count(tokenizer, text: str, special: bool) -> int:
    return len(tokenizer(text, add_special_tokens=special)["input_ids"])


def _plain(messages: list[dict[str, str]], tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    text, spans = "", []
    for k, m in enumerate(messages):
        if k:
            text += "\n"
        if m["role"] == "assistant":
            spans.append((_count(tokenizer, text, True), None))
        text += m["content"]
        if m["role"] == "assistant":
            spans[-1] = (spans[-1][0], _count(tokenizer, text, True))
    ids = tokenizer(text)["input_ids"]
    return ids, spans


def _chat(messages: list[dict[str, str]], tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--template chat needs a tokenizer with a chat template; use --template plain")
    render = tokenizer.apply_chat_template
    spans = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = _count(tokenizer, render(messages[:k], tokenize=False, add_generation_prompt=True), False)
            end = _count(tokenizer, render(messages[: k + 1], tokenize=False), False)
            spans.append((start, end))
    ids = tokenizer(render(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    return ids, spans


def tokenize(messages: list[dict[str, str]], tokenizer, template: str = "plain", max_length: int = 2048) -> Tokenized:
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    ids, spans = (_plain if template == "plain" else _chat)(messages, tokenizer)
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        labels[start:end] = ids[start:end]
    out = Tokenized(ids[:max_length], labels[:max_length], "ok")
    if all(not m["content"].strip() for m in messages if m["role"] == "assistant"):
        out.status = "empty_response"
    elif out.num_response_tokens == 0:
        out.status = "prompt_too_long"
    elif all(not m["content"].strip() for m in messages if m["role"] != "assistant"):
        out.status = "empty_prompt"
    return out
