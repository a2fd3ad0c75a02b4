import copy
import re

import pytest
from conftest import one_token_tokenizer

from gradspec.data.templates import IGNORE_INDEX, check_response_tokens, tokenize

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
    assert len(t.input_ids) == start + 2 and t.status == "truncated" and t.num_response_tokens == 2
    assert t.scorable and full.status == "ok"
    assert tokenize(ALPACA, tokenizer, "plain", max_length=len(full.input_ids)).status == "ok"  # fits exactly
    long_prompt = [{"role": "user", "content": "word " * 50}, ALPACA[1]]
    cut = tokenize(long_prompt, tokenizer, "plain", max_length=20)
    assert cut.status == "prompt_too_long" and cut.num_response_tokens == 0
    empty = tokenize([ALPACA[0], {"role": "assistant", "content": "  "}], tokenizer, "chat")
    assert empty.status == "empty_response"


def test_unknown_template(tokenizer):
    with pytest.raises(ValueError, match="template"):
        tokenize(ALPACA, tokenizer, "fancy")


def _with_template(tokenizer, chat_template):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = chat_template
    return copied


def test_plain_boundary_merge_is_flagged_not_shifted(tokenizer):
    """A prompt ending in "\n" before a response starting with a letter: alone, the prompt and the
    join end in one token "\n\n"; in the sample they are "\n" + "\n". The reference's count of the
    prompt's tokens labelled the join's "\n" as response."""
    messages = [{"role": "user", "content": "Name a colour:\n"}, {"role": "assistant", "content": "Blue."}]
    alone = tokenizer("Name a colour:\n\n")["input_ids"]
    t = tokenize(messages, tokenizer)
    assert t.input_ids[: len(alone)] != alone  # the merge: the prompt's ids are not a prefix
    assert t.status == "boundary_merge" and t.scorable
    assert tokenizer.decode(_response(t)) == "Blue."


def test_whitespace_merged_into_the_prompt_keeps_the_reference_labels(tokenizer):
    """HumanEval's case: a code prompt ending in "\n" and an indented solution. "\n\n   " is one
    token that starts in the prompt: it stays prompt, the labels are the reference's, the row ok."""
    prompt, solution = "def one():\n", "    return 1\n"
    start = len(tokenizer(prompt + "\n")["input_ids"])
    ids = tokenizer(prompt + "\n" + solution)["input_ids"]
    assert ids[:start] != tokenizer(prompt + "\n")["input_ids"]  # merged across the boundary
    t = tokenize([{"role": "user", "content": prompt}, {"role": "assistant", "content": solution}], tokenizer)
    assert t.status == "ok" and t.labels == [IGNORE_INDEX] * start + ids[start:]


class _SlowTokenizer:
    """No offsets; one token per character, except that "\n" and a digit after it are one."""

    is_fast = False

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [sum(map(ord, piece)) for piece in re.findall(r"\n\d|.", text, re.S)]}


def test_slow_tokenizer_counts_and_still_checks_the_prefix():
    tok = _SlowTokenizer()
    fine = tokenize([{"role": "user", "content": "Add 3 and 4"}, {"role": "assistant", "content": "Seven"}], tok)
    assert fine.status == "ok" and fine.labels == [IGNORE_INDEX] * 12 + fine.input_ids[12:]
    merged = tokenize([{"role": "user", "content": "Add 3 and 4"}, {"role": "assistant", "content": "7"}], tok)
    assert merged.status == "label_span_mismatch" and not merged.scorable
    assert set(merged.labels) == {IGNORE_INDEX}


# Strips the reasoning of every assistant turn but the last, as Qwen3's and DeepSeek-R1's templates do
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>greet back</think>Hello there."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "<think>any will do</think>Blue."},
]


def test_chat_template_that_rewrites_earlier_turns_is_flagged(tokenizer):
    tok = _with_template(tokenizer, THINK_TEMPLATE)
    t = tokenize(THINKING, tok, "chat")
    assert t.status == "label_span_mismatch" and not t.scorable and t.num_response_tokens == 0
    single = tokenize(THINKING[:2], tok, "chat")  # one turn: nothing earlier to rewrite
    assert single.status == "ok"
    assert tok.decode(_response(single)) == "<think>greet back</think>Hello there.<|im_end|>\n"


# Refuses a system turn, as Llama 2's and Mistral's templates refuse roles out of their order
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
                   "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_conversation_the_chat_template_refuses_is_a_flagged_row_not_a_crash(tokenizer):
    tok = _with_template(tokenizer, STRICT_TEMPLATE)
    refused = tokenize([{"role": "system", "content": "Be brief."}, *THINKING[:2]], tok, "chat")
    assert refused.status == "template_refused" and not refused.scorable and refused.num_tokens > 0
    assert set(refused.labels) == {IGNORE_INDEX}
    assert tokenize(THINKING[:2], tok, "chat").status == "ok"
    with pytest.raises(ValueError, match="the chat template refuses the conversations"):
        check_response_tokens({"template_refused": 9, "ok": 1})


# Marks the assistant's content and <|im_end|> for training, not the newline after it
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_generation_marks_are_the_labels(tokenizer):
    tok = _with_template(tokenizer, GENERATION_TEMPLATE)
    t = tokenize(THINKING, tok, "chat")
    assert t.status == "ok"
    assert tok.decode(_response(t)) == ("<think>greet back</think>Hello there.<|im_end|>"
                                        "<think>any will do</think>Blue.<|im_end|>")


def test_tokenizer_that_leaves_no_response_token():
    t = tokenize(ALPACA, one_token_tokenizer())
    assert t.num_tokens == 1 and t.status == "no_response_tokens" and not t.scorable


def test_most_rows_without_response_tokens_stop_the_run():
    check_response_tokens({"ok": 2, "prompt_too_long": 1, "empty_response": 1})  # half: flagged rows, no stop
    with pytest.raises(ValueError, match=r"^412 of 500 rows have no response tokens \(no_response_tokens 400, "
                                         r"prompt_too_long 12\): check the tokenizer and template$"):
        check_response_tokens({"ok": 88, "no_response_tokens": 400, "prompt_too_long": 12})


@pytest.mark.parametrize("template", ["plain", "chat"])
def test_sharegpt_loss_is_on_the_gpt_turns(tmp_path, tokenizer, template):
    import json

    from gradspec.data.readers import read_samples

    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."},
             {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]
    (tmp_path / "s.jsonl").write_text(json.dumps({"conversations": turns}) + "\n")
    [sample] = read_samples(tmp_path / "s.jsonl")
    t = tokenize(sample.messages, tokenizer, template)
    end = "<|im_end|>\n" if template == "chat" else ""  # plain: each gpt turn's content alone
    assert t.status == "ok" and tokenizer.decode(_response(t)) == f"Hello there.{end}Blue.{end}"
