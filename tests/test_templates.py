import pytest

from gradspec.engine import IGNORE_INDEX
from gradspec.templates import tokenize

ALPACA = [
    {"role": "user", "content": "Add two numbers.\n3 and 4"},
    {"role": "assistant", "content": "The sum is 7."},
]


def _response(t):
    return [i for i, label in zip(t.input_ids, t.labels, strict=True) if label != IGNORE_INDEX]


def test_plain_reproduces_reference(tokenizer):
    """Reference: text = instruction + "\\n" + input + "\\n" + output; the response starts at the
    token count of the text up to the output."""
    instruction, extra, output = "Add two numbers.", "3 and 4", "The sum is 7."
    text = instruction + "\n" + extra + "\n" + output
    start = len(tokenizer(instruction + "\n" + extra + "\n")["input_ids"])
    ids = tokenizer(text)["input_ids"]
    t = tokenize(ALPACA, tokenizer, "plain")
    assert t.input_ids == ids
    assert t.labels == [IGNORE_INDEX] * start + ids[start:]
    assert t.status == "ok" and t.num_response_tokens == len(ids) - start


def test_chat_labels_cover_assistant_turns_only(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
    t = tokenize(messages, tokenizer, "chat")
    assert tokenizer.decode(t.input_ids).startswith("<|im_start|>system")
    assert tokenizer.decode(_response(t)) == "Hello there.<|im_end|>\nBlue.<|im_end|>\n"


def test_right_truncation_and_flags(tokenizer):
    full = tokenize(ALPACA, tokenizer, "plain")
    start = full.labels.count(IGNORE_INDEX)
    t = tokenize(ALPACA, tokenizer, "plain", max_length=start + 2)
    assert len(t.input_ids) == start + 2 and t.status == "ok" and t.num_response_tokens == 2
    long_prompt = [{"role": "user", "content": "word " * 50}, ALPACA[1]]
    cut = tokenize(long_prompt, tokenizer, "plain", max_length=20)
    assert cut.status == "prompt_too_long" and cut.num_response_tokens == 0
    empty = tokenize([ALPACA[0], {"role": "assistant", "content": "  "}], tokenizer, "chat")
    assert empty.status == "empty_response"


def test_unknown_template(tokenizer):
    with pytest.raises(ValueError, match="template"):
        tokenize(ALPACA, tokenizer, "fancy")
