"""Turning chat messages into token ids and a response-only label mask, checked against the tokenizer.

Each template lays out the text and the character span of every assistant turn. ``plain``
reproduces the reference: the turns' contents joined by "\\n", a span is a turn's content.
``chat`` renders with the tokenizer's chat template: a span runs from the end of the generation
prompt of the turns before it to the end of its own rendering (for SmolLM2: the content and
``<|im_end|>\\n``); where the template marks assistant text with ``{% generation %}``, the
tokens it marks (transformers' assistant mask) are the labels instead.

The text is tokenized once. A token is a response token when its text (offset mapping) starts
inside a span, so a token across a boundary belongs to the side it starts on. Every boundary is
then verified: the text before it, tokenized alone, must give the sample's own first tokens (the
prompt's ids are a prefix of the sample's). The last of them may run on into whitespace after the
boundary (HumanEval: "\\n\\n   " before an indented solution): the labels are the reference's,
which counted the prompt's tokens, and the row is ``ok``. Otherwise the row is flagged:

- ``boundary_merge`` (scored, labels from the offsets): the tokenizer joins text across a boundary
  differently from the prompt alone (e.g. a prompt ending in "\\n" before a response starting
  with a letter: "\\n\\n" alone, "\\n" + "\\n" in the sample), so the model sees another prompt than
  the one it would be given; the reference's count shifted these labels by a token.
- ``label_span_mismatch`` (not scored, no labels): the chat template renders earlier turns
  differently inside the whole conversation (e.g. strips ``<think>`` from past assistant turns),
  or an assistant turn opens the conversation, or a tokenizer without offsets (counted spans)
  fails the prefix check: the span cannot be located.

A row longer than max_length is scored on its first max_length tokens and flagged ``truncated``
(beside any other flag: ``boundary_merge;truncated``).

A row with no response token to score is flagged too (``empty_response``, ``no_response_tokens``,
``prompt_too_long``, ``label_span_mismatch``) and ``check_response_tokens`` stops a run in which
most rows are. A scoring run judges this once, before it scores anything, on the input's first
``RESPONSE_CHECK_ROWS`` rows, which every process of the run reads whatever chunks it scores: a run
stops, or goes on, alike however it is split (shards, torchrun's ranks, ``--resume``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gradspec.choices import MAX_LENGTH
from gradspec.options import OptionError, mention

IGNORE_INDEX = -100  # the label of a token that carries no loss (prompt, padding): PyTorch's and transformers' default
TEMPLATES = ("plain", "chat")
# The input's first rows on which a scoring run judges whether most rows have no response token: enough
# to tell a setting (template, tokenizer, max length) from a few bad rows, few enough to tokenize in a moment
RESPONSE_CHECK_ROWS = 256
SCORED = ("ok", "empty_prompt", "boundary_merge", "truncated")
# Statuses of a row with no response token to score, and what usually causes most rows to have one
NO_RESPONSE = {
    "no_response_tokens": f"check the tokenizer and {mention('template')}",
    "label_span_mismatch": f"check {mention('template')} (the chat template rewrites earlier turns?) and the tokenizer",
    "prompt_too_long": f"the prompts fill {mention('max_length')}: raise it",
    "empty_response": "the responses are blank: check the output or messages field",
    "template_refused": f"the chat template refuses the conversations (roles in an order it does not take?): "
                        f"check the messages or use {mention('template')} plain",
}

Span = tuple[int, int]  # characters [start, end) of an assistant turn in the text
# An assistant message of TRL's prompt-completion layout (texts): the plain template joins it to the prompt as TRL
# does, prompt + completion + the tokenizer's EOS, without the "\n" between turns
JOINED = "joined"
# An assistant message of TRL's conversational prompt (an earlier turn the prompt holds): context, not scored, as
# TRL's completion-only loss masks the whole prompt
CONTEXT = "context"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]
    status: str  # SCORED ones are scored; the others (see NO_RESPONSE) are not

    @property
    def scorable(self) -> bool:
        return set(self.status.split(";")) <= set(SCORED)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_response_tokens(self) -> int:
        """Labelled tokens that have a preceding token to predict them from."""
        return _response_tokens(self.labels)


def _response_tokens(labels: list[int]) -> int:
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def scored(message: dict[str, str]) -> bool:
    """Whether a message is a response the loss is on: an assistant turn that is not context."""
    return message["role"] == "assistant" and not message.get(CONTEXT, False)


def _plain_text(messages: list[dict[str, str]], eos: str = "") -> tuple[str, list[Span]]:
    """The reference's text (contents joined by "\\n") and each assistant content's span; a JOINED turn
    follows the one before it directly and ends in eos, as TRL joins a prompt and its completion."""
    text, spans = "", []
    for k, m in enumerate(messages):
        joined = m.get(JOINED, False)
        if k and not joined:
            text += "\n"
        content = m["content"] + (eos if joined and eos and not m["content"].endswith(eos) else "")
        if scored(m):
            spans.append((len(text), len(text) + len(content)))
        text += content
    return text, spans


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _chat_text(messages: list[dict[str, str]], tokenizer) -> tuple[str, list[Span] | None]:
    """The rendered conversation and each assistant turn's span, from the end of the generation
    prompt before it to the end of its own rendering; None when a turn's prompt or rendering is
    not where the whole conversation has it (a template that rewrites earlier turns)."""
    if not getattr(tokenizer, "chat_template", None):
        raise OptionError("template", "chat needs a tokenizer with a chat template; use plain")
    text, spans = _render(tokenizer, messages), []
    for k, m in enumerate(messages):
        if not scored(m):
            continue
        if k == 0:
            return text, None  # no turn before it: no generation prompt to start from
        before, through = _render(tokenizer, messages[:k], True), _render(tokenizer, messages[: k + 1])
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            return text, None
        spans.append((len(before), len(through)))
    return text, spans


def _marked_spans(messages: list[dict[str, str]], tokenizer) -> list[Span]:
    """Character spans of the tokens the chat template marks with {% generation %}."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                        tokenizer_kwargs={"return_offsets_mapping": True})
    spans: list[Span] = []
    previous = False
    for (start, end), marked in zip(out["offset_mapping"], out["assistant_masks"], strict=True):
        if marked and previous:
            spans[-1] = (spans[-1][0], end)
        elif marked:
            spans.append((start, end))
        previous = bool(marked)
    return spans


def _boundary_holds(tokenizer, text: str, cut: int, ids: list[int], offsets: list[Span], head: int) -> bool:
    """Whether the text before `cut`, tokenized alone, gives the sample's tokens up to `cut`; its
    last token may run on into whitespace after `cut` (the same labels as the reference's)."""
    if cut <= 0 or cut >= len(text):
        return True
    alone = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
    if sum(1 for start, end in offsets if end > start and start < cut) != len(alone):
        return False
    n = head + len(alone)
    if ids[head:n] == alone:
        return True
    blank = len(text[cut:]) - len(text[cut:].lstrip())
    return blank > 0 and ids[head:n - 1] == alone[:-1] and offsets[n - 1][1] <= cut + blank


def _offset_labels(tokenizer, text: str, spans: list[Span], cuts: set[int],
                   special: bool) -> tuple[list[int], list[int], bool]:
    """(ids, labels, every cut holds): labelled are the tokens whose text starts inside a span."""
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    labels = [i if end > start and any(a <= start < b for a, b in spans) else IGNORE_INDEX
              for i, (start, end) in zip(ids, offsets, strict=True)]
    head = next((k for k, (start, end) in enumerate(offsets) if end > start), len(ids))  # added special tokens
    holds = all(_boundary_holds(tokenizer, text, cut, ids, offsets, head) for cut in cuts)
    return ids, labels, holds


def _counted_labels(tokenizer, text: str, spans: list[Span], cuts: set[int],
                    special: bool) -> tuple[list[int], list[int], bool]:
    """Without offsets (a slow tokenizer): the reference's token counts of the text before each
    boundary, and whether each of those prefixes is exactly a prefix of the sample's ids."""
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    before = {cut: tokenizer(text[:cut], add_special_tokens=special)["input_ids"] if cut < len(text) else ids
              for cut in cuts}
    labels = [IGNORE_INDEX] * len(ids)
    for a, b in spans:
        start, end = len(before[a]), len(before[b])
        labels[start:end] = ids[start:end]
    return ids, labels, all(ids[: len(p)] == p for p in before.values())


def _status(messages: list[dict[str, str]], labels: list[int], kept: list[int], located: bool, holds: bool) -> str:
    """The row's status: first the reasons it has no response token, then the scored flags."""
    if all(not m["content"].strip() for m in messages if scored(m)):
        return "empty_response"
    if not located:
        return "label_span_mismatch"
    if _response_tokens(labels) == 0:
        return "no_response_tokens"
    if _response_tokens(kept) == 0:
        return "prompt_too_long"
    if not holds:
        return "boundary_merge"
    if all(not m["content"].strip() for m in messages if not scored(m)):
        return "empty_prompt"
    return "ok"


def tokenize(messages: list[dict[str, str]], tokenizer, template: str = "plain",
             max_length: int = MAX_LENGTH) -> Tokenized:
    """Token ids and response labels of one conversation, verified against the tokenizer (see
    the module's docstring for the statuses); truncated on the right at max_length."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    refused = False
    if template == "plain":
        text, spans = _plain_text(messages, getattr(tokenizer, "eos_token", None) or "")
    else:
        from jinja2 import TemplateError

        try:
            text, spans = _chat_text(messages, tokenizer)
        except TemplateError:  # its raise_exception (Llama 2's "roles must alternate"): the row, not the run
            (text, _), spans, refused = _plain_text(messages), None, True
    located = spans is not None
    spans = spans or []
    cuts = {x for span in spans for x in span}
    fast = getattr(tokenizer, "is_fast", False)
    if located and template == "chat" and fast and _GENERATION.search(str(tokenizer.chat_template)):
        turns = spans  # the marked tokens of the scored turns (the template marks every assistant turn)
        spans = [s for s in _marked_spans(messages, tokenizer) if any(a <= s[0] < b for a, b in turns)]
        cuts |= {x for span in spans for x in span}
    label = _offset_labels if fast else _counted_labels
    ids, labels, holds = label(tokenizer, text, spans, cuts, template == "plain")
    if not fast and not holds:
        located = False  # counted spans that fail the check are shifted: no labels rather than wrong ones
    if not located:
        labels = [IGNORE_INDEX] * len(ids)
    status = "template_refused" if refused else _status(messages, labels, labels[:max_length], located, holds)
    if len(ids) > max_length and status in SCORED:  # scored on its first max_length tokens: say so
        status = "truncated" if status == "ok" else f"{status};truncated"
    return Tokenized(ids[:max_length], labels[:max_length], status)


def check_response_tokens(statuses: Mapping[str, int], judged: str | None = None) -> None:
    """Stops a run in which most rows (statuses: how many rows have each) have no response token
    to score: that is a setting (template, tokenizer, max length), not the data, and flagging
    every row would hide it. judged: which rows the statuses are of, where the error should say."""
    total = sum(statuses.values())
    missing = {s: n for s, n in statuses.items() if s in NO_RESPONSE and n}
    if not total or sum(missing.values()) <= total / 2:
        return
    cause = max(missing, key=missing.__getitem__)
    details = ", ".join(f"{s} {n}" for s, n in sorted(missing.items(), key=lambda x: -x[1]))
    raise OptionError((), f"{sum(missing.values())} of {total} rows have no response tokens ({details}): "
                          f"{NO_RESPONSE[cause]}" + (f" (judged on {judged})" if judged else ""))
