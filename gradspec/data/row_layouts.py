"""Row layouts: which fields of a record hold the text, and how they become chat messages. Alpaca:
user = instruction [+ "\\n" + input], assistant = output; chat messages (role/content); ShareGPT:
``conversations`` of from/value turns, human -> user, gpt -> assistant; TRL's prompt-completion. The
record's other scalar fields are carried into the output. ``Fields`` names the fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gradspec.data.errors import InputError
from gradspec.data.sample import Sample
from gradspec.data.templates import CONTEXT, JOINED
from gradspec.options import check_options, option


@dataclass(frozen=True)
class Fields:
    """Names of the text fields in the input: which column holds what.

    Args:
        instruction: the instruction (with input and output: Alpaca's layout).
        input: the instruction's input, appended to it when present.
        output: the response.
        messages: chat messages (role/content), the last assistant turn the response.
        conversations: ShareGPT's from/value turns.
        prompt: TRL's prompt-completion layout: the prompt (text, or a list of messages).
        completion: the completion (text, joined to the prompt as TRL joins it, or a list of messages).
    """

    instruction: str = option("instruction", "the input's column of instructions", name="instruction_field")
    input: str = option("input", "its column of inputs to the instruction", name="input_field")
    output: str = option("output", "its column of responses", name="output_field")
    messages: str = option("messages", "its column of chat messages", name="messages_field")
    conversations: str = option("conversations", "its column of ShareGPT's from/value turns",
                                name="conversations_field")
    prompt: str = option("prompt", "its column of prompts (TRL's prompt-completion layout)", name="prompt_field")
    completion: str = option("completion", "its column of completions (TRL's prompt-completion layout)",
                             name="completion_field")

    def __post_init__(self) -> None:
        check_options(self)


def _text(record: dict, name: str, where: str, required: bool) -> str:
    value = record.get(name)
    if value is None:
        if required:
            raise InputError(f"{where}: missing field {name!r}")
        return ""
    if not isinstance(value, str):
        raise InputError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return _unicode(value, f"field {name!r}", where)


def _unicode(text: str, what: str, where: str) -> str:
    """text, or an InputError naming where and what: a tokenizer (and a Parquet file) takes only text
    that encodes as UTF-8, which a lone surrogate (JSON's "\\ud800" unpaired) does not; HF's fast
    tokenizers meet one with a TypeError that names no row."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where}: {what} is not valid Unicode text (a lone surrogate, {text[e.start]!r}, at "
                         f"character {e.start})") from None
    return text


# ShareGPT's speakers -> chat roles (the loss is on the assistant's turns)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}


def _messages(record: dict, name: str, where: str) -> list[dict[str, str]]:
    """A conversation as role/content messages; each turn may be chat's role/content or ShareGPT's
    from/value (whichever field holds the list)."""
    raw = record[name]
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}: field {name!r} must be a non-empty list of role/content "
                         f"(or ShareGPT from/value) objects")
    out = []
    for k, m in enumerate(raw):
        if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
            out.append({"role": _unicode(m["role"], f"{name}[{k}].role", where),
                        "content": _unicode(m["content"], f"{name}[{k}].content", where)}
                       | {key: True for key in (JOINED, CONTEXT) if m.get(key) is True})  # a TRL row's, passed on
        elif isinstance(m, dict) and isinstance(m.get("from"), str) and isinstance(m.get("value"), str):
            if m["from"] not in SHAREGPT_ROLES:
                raise InputError(f"{where}: {name}[{k}] is from {m['from']!r}; ShareGPT speakers understood: "
                                 f"{', '.join(SHAREGPT_ROLES)}")
            out.append({"role": SHAREGPT_ROLES[m["from"]],
                        "content": _unicode(m["value"], f"{name}[{k}].value", where)})
        else:
            raise InputError(f"{where}: {name}[{k}] must have string 'role' and 'content' (or ShareGPT's "
                             f"'from' and 'value')")
    if not any(m["role"] == "assistant" for m in out):
        raise InputError(f"{where}: {name!r} has no assistant turn to score")
    return out


def _prompt_completion(record: dict, fields: Fields, where: str) -> list[dict]:
    """TRL's prompt-completion row as messages: lists of messages (its conversational form) one after the
    other, the prompt's assistant turns marked CONTEXT (TRL's loss is on the completion alone); texts as
    a user and an assistant turn marked JOINED, which the plain template joins as TRL does (prompt +
    completion + EOS, no separator)."""
    prompt, completion = record[fields.prompt], record[fields.completion]
    if isinstance(prompt, list) and isinstance(completion, list):
        name = f"{fields.prompt}+{fields.completion}"
        messages = _messages({name: prompt + completion}, name, where)
        if not any(m["role"] == "assistant" for m in messages[len(prompt):]):
            raise InputError(f"{where}: {fields.completion!r} has no assistant turn to score")
        return [m | {CONTEXT: True} if k < len(prompt) and m["role"] == "assistant" else m
                for k, m in enumerate(messages)]
    return [{"role": "user", "content": _text(record, fields.prompt, where, required=True)},
            {"role": "assistant", "content": _text(record, fields.completion, where, required=True), JOINED: True}]


def to_sample(index: int, where: str, record: dict, fields: Fields = Fields()) -> Sample:
    """One record -> Sample; scalar columns other than the text fields are carried. Every row of every
    reader comes through here, so here each text it keeps (messages, carried values and their names) is
    checked to be text a tokenizer takes (_unicode): a bad row is the row's InputError, not a crash."""
    chat = next((name for name in (fields.messages, fields.conversations) if name in record), None)
    if chat is not None:
        messages = _messages(record, chat, where)
        text_fields = {chat}
    elif fields.instruction in record or fields.output in record:
        instruction = _text(record, fields.instruction, where, required=True)
        extra = _text(record, fields.input, where, required=False)
        output = _text(record, fields.output, where, required=True)
        prompt = instruction + ("\n" + extra if extra else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
        text_fields = {fields.instruction, fields.input, fields.output}
    elif fields.prompt in record and fields.completion in record:  # TRL's prompt-completion layout
        messages = _prompt_completion(record, fields, where)
        text_fields = {fields.prompt, fields.completion}
    else:
        wrapped = next((k for k, v in record.items() if isinstance(v, list) and v and isinstance(v[0], dict)), None)
        if wrapped is not None:  # {"data": [rows]}: the rows inside an object, not a field named wrongly
            raise InputError(f"{where}: an object whose {wrapped!r} holds a list of {len(record[wrapped])} objects: "
                             f"rows inside an object are not read; give the list itself (e.g. jq '.{wrapped}' "
                             "file.json > rows.json)")
        raise InputError(
            f"{where}: expected Alpaca fields {fields.instruction!r}, {fields.output!r} "
            f"(optional {fields.input!r}), a chat field {fields.messages!r}, a ShareGPT field "
            f"{fields.conversations!r} or TRL's {fields.prompt!r} and {fields.completion!r}; found "
            f"{sorted(record)}: name yours with --instruction-field, --output-field, --messages-field, "
            "--conversations-field, --prompt-field or --completion-field"
        )
    carried = {k: v for k, v in record.items() if k not in text_fields and _is_scalar(v)}
    for name, value in carried.items():  # written to the output, which takes only UTF-8 text too
        _unicode(name, f"field name {name!r}", where)
        if isinstance(value, str):
            _unicode(value, f"field {name!r}", where)
    return Sample(index, messages, carried)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return True
    return value is None or isinstance(value, (str, int, float, bool))
