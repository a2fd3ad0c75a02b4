import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.data.errors import InputError
from gradspec.data.readers import HUMANEVAL_SIZE, Fields, count_records, humaneval_samples, read_samples

ROWS = [
    {"instruction": "Say hi", "output": "hi", "reward": 1.5, "id": "a"},
    {"instruction": "Add", "input": "1 2", "output": "3", "reward": -0.5, "id": "b"},
]


def _columns(rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}


def _check(samples):
    assert [s.index for s in samples] == [0, 1]
    assert samples[1].messages == [{"role": "user", "content": "Add\n1 2"}, {"role": "assistant", "content": "3"}]
    assert samples[0].carried == {"reward": 1.5, "id": "a"}


def test_json_jsonl_parquet(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    pq.write_table(pa.table(_columns(ROWS)), tmp_path / "d.parquet")
    for name in ("d.json", "d.jsonl", "d.parquet"):
        _check(list(read_samples(tmp_path / name)))


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(_columns(ROWS)).save_to_disk(str(tmp_path / "ds"))
    _check(list(read_samples(tmp_path / "ds")))


def test_chat_format_and_custom_fields(tmp_path):
    rows = [{"conv": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "score": 3}]
    (tmp_path / "c.jsonl").write_text(json.dumps(rows[0]))
    [s] = read_samples(tmp_path / "c.jsonl", Fields(messages="conv"))
    assert s.messages[1] == {"role": "assistant", "content": "a"} and s.carried == {"score": 3}
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "p", "answer": "r"}]))
    [s] = read_samples(tmp_path / "a.json", Fields(instruction="prompt", output="answer"))
    assert s.messages[1]["content"] == "r"


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{not json\n")
    it = read_samples(path)
    assert next(it).index == 0 and next(it).index == 1  # rows before the bad line come through
    with pytest.raises(InputError, match=rf"{path}:3: malformed JSON"):
        next(it)


def test_malformed_json_list_names_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"instruction": "a", "output": "b"},\n{"instruction": oops}\n]')
    with pytest.raises(InputError, match=rf"{path}:3: malformed JSON"):
        list(read_samples(path))


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"instruction": "\xff", "output": "x"}\n')
    with pytest.raises(InputError, match=rf"{path}:2: invalid UTF-8"):
        list(read_samples(path))


def test_missing_and_wrong_fields_say_what_was_expected(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}))
    with pytest.raises(InputError, match=r"m.jsonl:1: expected Alpaca fields 'instruction', 'output'.*'messages'"):
        list(read_samples(path))
    path.write_text(json.dumps({"instruction": "q"}))
    with pytest.raises(InputError, match=r"missing field 'output'"):
        list(read_samples(path))
    path.write_text(json.dumps({"instruction": "q", "output": 5}))
    with pytest.raises(InputError, match=r"field 'output' must be a string, got int"):
        list(read_samples(path))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}))
    with pytest.raises(InputError, match="no assistant turn"):
        list(read_samples(path))


def test_rows_wrapped_in_an_object_are_named_as_such(tmp_path):
    """{"version": ..., "data": [rows]}: said to be rows inside an object, not a hint about field names."""
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"version": 1, "data": [{"instruction": "q", "output": "a"}] * 3}))
    with pytest.raises(InputError, match=r"w.json element 0: an object whose 'data' holds a list of 3 objects: rows "
                                         r"inside an object are not read; give the list itself \(e.g. jq '.data'"):
        list(read_samples(path))


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        list(read_samples(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="unknown format"):
        list(read_samples(tmp_path / "x.csv"))


def test_limit_and_builtin_humaneval():
    samples = list(humaneval_samples(3))
    assert len(samples) == 3 and samples[0].carried["task_id"] == "HumanEval/0"
    assert len(list(humaneval_samples())) == HUMANEVAL_SIZE == 164


def test_count_records(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    pq.write_table(pa.table(_columns(ROWS)), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    assert count_records(tmp_path / "d.jsonl") == 2 and count_records(tmp_path / "d.parquet") == 2
    assert count_records(tmp_path / "d.json") == 2


def test_unwanted_rows_are_not_parsed_and_skip_keeps_going(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{broken\n\n" + json.dumps(ROWS[1]) + "\n")
    assert [s.index for s in read_samples(path, wanted=lambda i: i != 1)] == [0, 2]  # line 2 never parsed
    pq.write_table(pa.table(_columns(ROWS)), tmp_path / "d.parquet")
    assert [s.index for s in read_samples(tmp_path / "d.parquet", wanted=lambda i: i == 1)] == [1]
    samples = list(read_samples(path, on_error="skip"))
    assert [(s.index, s.error) for s in samples] == [(0, None), (1, f"{path}:2: malformed JSON: Expecting "
                                                     "property name enclosed in double quotes (column 2)"), (2, None)]
    with pytest.raises(ValueError, match="on_error must be one of"):
        list(read_samples(path, on_error="ignore"))


SHAREGPT = {"id": "x1", "conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
    {"from": "gpt", "value": "Hello there."}, {"from": "human", "value": "Name a colour."},
    {"from": "gpt", "value": "Blue."}]}


def test_sharegpt_conversations_are_recognised(tmp_path):
    (tmp_path / "s.jsonl").write_text(json.dumps(SHAREGPT) + "\n")
    [s] = read_samples(tmp_path / "s.jsonl")
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in s.messages] == [t["value"] for t in SHAREGPT["conversations"]]
    assert s.carried == {"id": "x1"}
    (tmp_path / "c.json").write_text(json.dumps([{"turns": SHAREGPT["conversations"]}]))  # a custom field
    [s] = read_samples(tmp_path / "c.json", Fields(conversations="turns"))
    assert s.messages[2] == {"role": "assistant", "content": "Hello there."}


def test_sharegpt_problems_name_the_row_and_turn(tmp_path):
    turns = SHAREGPT["conversations"]
    bad = [{"conversations": turns[:2] + [{"from": "bard?", "value": "x"}]},
           {"conversations": turns[:1] + [{"from": "human"}]},
           {"conversations": turns[:2]}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    samples = list(read_samples(tmp_path / "b.jsonl", on_error="skip"))
    assert [s.error for s in samples] == [
        f"{tmp_path / 'b.jsonl'}:1: conversations[2] is from 'bard?'; ShareGPT speakers understood: "
        "human, user, gpt, assistant, chatgpt, system",
        f"{tmp_path / 'b.jsonl'}:2: conversations[1] must have string 'role' and 'content' (or ShareGPT's "
        "'from' and 'value')",
        f"{tmp_path / 'b.jsonl'}:3: 'conversations' has no assistant turn to score"]


def test_a_byte_order_mark_is_read_past(tmp_path):
    """Windows editors start UTF-8 files with a BOM; json refuses it."""
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in ROWS).encode())
    (tmp_path / "d.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS).encode())
    for name in ("d.jsonl", "d.json"):
        _check(list(read_samples(tmp_path / name)))



GOOD = {"instruction": "q", "output": "r"}
CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
# A lone surrogate (JSON's escape "\ud800" unpaired) wherever a row keeps text: the field an error names, the
# surrogate, and where in the field's text it is
SURROGATES = [
    ({"instruction": "s \ud800", "output": "r"}, "field 'instruction'", "\ud800", 2),
    ({**GOOD, "input": "\udfff"}, "field 'input'", "\udfff", 0),
    ({"instruction": "q", "output": "ok \udc00"}, "field 'output'", "\udc00", 3),
    ({"messages": [{"role": "system", "content": "Be \ud800 brief."}, *CHAT]}, "messages[0].content", "\ud800", 3),
    ({"messages": [{"role": "user\ud800", "content": "q"}, CHAT[1]]}, "messages[0].role", "\ud800", 4),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "\ud800"}]},
     "conversations[1].value", "\ud800", 0),
    ({**GOOD, "id": "a\ud800"}, "field 'id'", "\ud800", 1),  # carried into the output, which is UTF-8 too
    ({**GOOD, "\ud800": 1}, "field name '\\ud800'", "\ud800", 0),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_lone_surrogate_anywhere_in_a_row_is_that_rows_input_error(tmp_path, suffix):
    """Not a TypeError from the tokenizer later, naming no row: read, the row is flagged (or, by
    default, refused) naming its line and field; a pair escaped as two (an emoji) is one character."""
    rows = [row for bad, *_ in SURROGATES for row in (bad, GOOD)] + [{"instruction": "\ud83d\ude00", "output": "r"}]
    path = tmp_path / f"d{suffix}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl" else json.dumps(rows))
    samples = list(read_samples(path, on_error="skip"))
    where = [f"{path}:{k + 1}" if suffix == ".jsonl" else f"{path} element {k}" for k in range(len(rows))]
    assert [s.error for s in samples[:-1:2]] == [
        f"{where[2 * k]}: {field} is not valid Unicode text (a lone surrogate, {char!r}, at character {at})"
        for k, (_, field, char, at) in enumerate(SURROGATES)]
    assert all(s.error is None for s in samples[1::2]) and samples[-1].messages[0]["content"] == "\U0001f600"
    with pytest.raises(InputError, match=rf"^{where[0]}: field 'instruction' is not valid Unicode text"):
        list(read_samples(path))


def test_json_that_python_cannot_read_is_the_rows_input_error(tmp_path):
    """Python's parser refuses a number of over 4300 digits and nesting past its recursion limit with a
    ValueError or RecursionError that names no file: each is its row's error, as malformed JSON is."""
    lines = [json.dumps(ROWS[0]), '{"instruction": "q", "output": "r", "n": ' + "9" * 5000 + "}", "[" * 100_000,
             json.dumps(ROWS[1])]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    samples = list(read_samples(path, on_error="skip"))
    assert [s.error is None for s in samples] == [True, False, False, True]
    assert samples[1].error.startswith(f"{path}:2: JSON that Python cannot read (Exceeds the limit (4300 digits)")
    assert samples[2].error.startswith(f"{path}:3: JSON that Python cannot read (maximum recursion depth exceeded")
    for text in lines[1:3]:
        (tmp_path / "d.json").write_text(text)
        with pytest.raises(InputError, match=rf"^{tmp_path / 'd.json'}: JSON that Python cannot read \("):
            list(read_samples(tmp_path / "d.json"))


def test_an_unreadable_parquet_file_is_named(tmp_path):
    """pyarrow's errors for a truncated file, or a corrupt page met while reading, name no file."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table(_columns(ROWS)), path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    for read in (count_records, lambda p: list(read_samples(p, on_error="skip"))):
        with pytest.raises(InputError, match=rf"^{path}: not a readable Parquet file \(Parquet magic bytes not found"):
            read(path)
    path.write_bytes(whole[:4] + b"\xff" * 8 + whole[12:])  # the first page's header garbled, the footer whole
    assert count_records(path) == 2
    with pytest.raises(InputError, match=rf"^{path}: not a readable Parquet file \(Couldn't deserialize thrift"):
        list(read_samples(path, on_error="skip"))


def test_a_parquet_value_that_will_not_convert_is_its_rows_input_error(tmp_path):
    """A string column's bytes that are not UTF-8 (pyarrow writes them unchecked) fail the conversion of
    their whole batch: the row alone is flagged, naming the column."""
    offsets = pa.array([0, 2, 4], pa.int32()).buffers()[1]
    instructions = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"instruction": instructions, "output": ["a", "b"]}), path)
    samples = list(read_samples(path, on_error="skip"))
    assert samples[0].messages[0]["content"] == "ok" and samples[0].error is None
    assert samples[1].error == (f"{path} row 1: column 'instruction' cannot be read ('utf-8' codec can't decode "
                                "byte 0xff in position 0: invalid start byte)")
