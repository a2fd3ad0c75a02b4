"""Random input through every reader (JSON, JSONL, Parquet; Alpaca, chat and ShareGPT rows) and both
templates: nothing escapes but gradspec's own InputError, naming the file on one line (issue 37: a lone
surrogate in one row ended a run in the tokenizer's TypeError, naming no file). Seeded and of a fixed
size, so it runs in a few seconds, the same cases every time."""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.data.errors import InputError
from gradspec.data.readers import Sample, count_records, read_samples
from gradspec.data.templates import TEMPLATES, tokenize

FILES = 200  # per format
# Text that stresses a reader or a tokenizer: lone surrogates (JSON's escapes), NUL and other controls, a BOM,
# non-characters, an astral character, a combining mark, JSON's own syntax and a chat template's markers
PIECES = ["a", "Blue.", " ", "\n", "\t", "\x00", "\x1b", "\ufeff", "\uffff", "\U0001f600", "\u0301", "é", "{", '"',
          "\\", "<|im_end|>", "{{ x }}"]
LONE = ["\ud800", "\udfff"]  # lone surrogates: what JSON's escapes "\ud800" read as
KEYS = ["instruction", "input", "output", "messages", "conversations", "role", "content", "from", "value", "id",
        "\ud800"]
ROLES = ["user", "assistant", "system", "human", "gpt", "chatgpt", "tool", "bard", "", "\udc00"]
SCALARS = [None, True, 0, -1, 2**70, 1.5, float("nan"), float("inf"), -1e308]


def _text(rng: random.Random, surrogates: bool = True) -> str:
    """A few pieces of text; one in twenty, with surrogates allowed, holds a lone surrogate."""
    text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(5)))
    if surrogates and rng.random() < 0.05:
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(LONE) + text[at:]
    return text


def _value(rng: random.Random, depth: int = 0):
    """Any JSON value: mostly text, sometimes a scalar of another type, a list or an object."""
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind < 2:
        return _text(rng)
    if kind < 4:
        return rng.choice(SCALARS)
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _leaf(rng: random.Random, key: str, role: str):
    """A turn's or a field's value: usually of the right kind (role: the turn's usual one), else anything."""
    if rng.random() < 0.1:
        return _value(rng, 2)
    if key not in ("role", "from"):
        return _text(rng)
    return role if rng.random() < 0.8 else rng.choice(ROLES)


def _row(rng: random.Random):
    """One row: an Alpaca, chat or ShareGPT one with random leaves (and extra columns), or any value."""
    shape = rng.choice([0, 0, 0, 1, 1, 2, 2, 3, 4])
    if shape == 0:
        row = {k: _leaf(rng, k, "") for k in ("instruction", "input", "output") if rng.random() < 0.95}
    elif shape in (1, 2):
        field, keys, roles = ("messages", ("role", "content"), ("user", "assistant")) if shape == 1 else \
            ("conversations", ("from", "value"), ("human", "gpt"))
        row = {field: [{k: _leaf(rng, k, roles[t % 2]) for k in keys} for t in range(rng.randrange(2, 5))]}
    elif shape == 3:
        return _value(rng)
    else:
        row = {rng.choice(KEYS): _value(rng) for _ in range(rng.randrange(4))}
    for _ in range(rng.randrange(3)):  # columns beside the text, carried (or one in ten: any of KEYS)
        row[rng.choice(KEYS) if rng.random() < 0.1 else rng.choice(["id", "score"])] = _value(rng, 3)
    return row


# JSON that Python's parser refuses though it is well formed: a number of over 4300 digits, nesting too deep
UNPARSED = [b'{"instruction": "q", "output": "r", "n": ' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000]


def _garbled(rng: random.Random, data: bytes) -> bytes:
    """data with a few random bytes changed, cut short, random bytes or JSON that Python cannot read instead."""
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randbytes(rng.randrange(64)) if rng.random() < 0.8 else rng.choice(UNPARSED)
    if kind == 1:
        return data[: rng.randrange(len(data) + 1)]
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        if out:
            out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def _jsonl(rng: random.Random) -> bytes:
    lines = [json.dumps(_row(rng)).encode() for _ in range(rng.randrange(1, 6))]
    if rng.random() < 0.5:
        k = rng.randrange(len(lines))
        lines[k] = _garbled(rng, lines[k]).replace(b"\n", b" ")
    return b"\n".join(lines) + b"\n"


def _json(rng: random.Random) -> bytes:
    data = json.dumps([_row(rng) for _ in range(rng.randrange(4))] if rng.random() < 0.8 else _row(rng)).encode()
    return _garbled(rng, data) if rng.random() < 0.3 else data


def _turns(rng: random.Random, speaker: str, text: str, roles: tuple[str, str]) -> list[dict[str, str]]:
    """A Parquet row's conversation: its turns' speakers usually alternate as roles give them."""
    return [{speaker: roles[t % 2] if rng.random() < 0.8 else rng.choice(ROLES[:-1]), text: _text(rng, False)}
            for t in range(rng.randrange(2, 5))]


# Parquet columns of each kind a file may hold: (arrow type, a random value of it)
COLUMNS = {
    "text": (pa.string(), lambda rng: _text(rng, surrogates=False) if rng.random() < 0.9 else None),
    "bytes": (pa.binary(), lambda rng: rng.randbytes(rng.randrange(4))),
    "int": (pa.int64(), lambda rng: rng.randrange(-(2**63), 2**63)),
    "float": (pa.float64(), lambda rng: rng.choice([1.5, float("nan"), float("inf"), None])),
    "chat": (pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
             lambda rng: _turns(rng, "role", "content", ("user", "assistant"))),
    "sharegpt": (pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())])),
                 lambda rng: _turns(rng, "from", "value", ("human", "gpt"))),
    "time": (pa.timestamp("us"), lambda rng: rng.choice([0, 2**62, -(2**62), None])),  # beyond Python's dates too
    "map": (pa.map_(pa.string(), pa.string()), lambda rng: [("role", "user")]),
}


def _not_utf8(rng: random.Random, rows: int) -> pa.Array:
    """A string column whose bytes need not be UTF-8: pyarrow writes them unchecked."""
    data = rng.randbytes(2 * rows)
    offsets = pa.array(range(0, 2 * rows + 1, 2), pa.int32()).buffers()[1]
    return pa.Array.from_buffers(pa.string(), rows, [None, offsets, pa.py_buffer(data)])


# A Parquet file's text columns, of each layout, and the kind of each (the right one, mostly)
LAYOUTS = [{"instruction": "text", "input": "text", "output": "text"}, {"messages": "chat"},
           {"conversations": "sharegpt"}]


def _parquet(rng: random.Random, path: Path) -> bytes:
    rows = rng.randrange(1, 5)
    kinds = {**rng.choice(LAYOUTS), **{rng.choice(["id", "score", "output"]): "any" for _ in range(rng.randrange(3))}}
    columns = {}
    for name, kind in kinds.items():
        if kind == "any" or rng.random() < 0.2:
            kind = rng.choice([*COLUMNS, "not_utf8"])
        if kind == "not_utf8":
            columns[name] = _not_utf8(rng, rows)
        else:
            arrow_type, make = COLUMNS[kind]
            columns[name] = pa.array([make(rng) for _ in range(rows)], arrow_type)
    pq.write_table(pa.table(columns), path)
    data = path.read_bytes()
    return _garbled(rng, data) if rng.random() < 0.3 else data


def _check(path: Path, tokenizer) -> tuple[int, list[str]]:
    """Reads path every way a run does and tokenizes each row read with both templates; an error may
    only be an InputError, or a row's error, that names the file on one line. Returns how many rows
    were read whole, and the errors."""
    read, errors = 0, []
    for on_error in ("skip", "fail"):
        try:
            count_records(path)
            for sample in read_samples(path, on_error=on_error):
                if sample.error is None:
                    read += 1
                    _check_sample(sample, tokenizer)
                else:
                    errors.append(sample.error)
        except InputError as e:
            errors.append(str(e))
    for message in errors:
        assert message.startswith(str(path)) and "\n" not in message, message
        message.encode("utf-8")  # printed, and written to the output's error column
    return read, errors


def _check_sample(sample: Sample, tokenizer) -> None:
    for template in TEMPLATES:
        tokenize(sample.messages, tokenizer, template, max_length=32)
    for name, value in sample.carried.items():  # written to the output: UTF-8 text
        name.encode("utf-8")
        if isinstance(value, str):
            value.encode("utf-8")


# What each format's cases must have met, so that the generators keep reaching them
JSON_MET = ["is not valid Unicode text (a lone surrogate", "malformed JSON", "invalid UTF-8", "Python cannot read"]
MET = {".jsonl": JSON_MET, ".json": JSON_MET,
       ".parquet": ["not a readable Parquet file", "cannot be read ('utf-8' codec", "cannot be read (date value"]}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_random_input_meets_only_input_errors(tmp_path, tokenizer, suffix):
    rng = random.Random(f"gradspec-fuzz{suffix}")
    read, errors = 0, []
    for case in range(FILES):
        path = tmp_path / f"{case}{suffix}"
        data = _parquet(rng, path) if suffix == ".parquet" else _jsonl(rng) if suffix == ".jsonl" else _json(rng)
        path.write_bytes(data)
        rows, problems = _check(path, tokenizer)
        read, errors = read + rows, errors + problems
    assert read > FILES // 2  # rows got through to the templates, not only errors
    assert all(any(kind in e for e in errors) for kind in MET[suffix]), MET[suffix]
