"""Options declared once. A dataclass field made by ``option()`` carries its help, kind, choices and
bound; from it come the Python keyword argument (its type check, its place in a generated
signature and docstring), the CLI flag (gradspec.cli.options), the config-file key and the
manifest entry. Adding an option to a run is adding one field.

Errors about an option name it as its caller does (OptionError): the parameter for Python
(``max_length``), the flag for the command line (``--max-length``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import numbers
import os
import re
import reprlib
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KIND_WORDS = {"int": "an int", "float": "a number", "bool": "a bool", "str": "a str",
              "strs": "a str or a list of str", "path": "a str or a pathlib.Path", "device": "a str or a torch.device",
              "pairs": "a dict of str keys, or a list of KEY=VALUE str"}


class OptionError(ValueError):
    """A bad value of one or more options, named as the caller names them: str() gives the Python
    parameters' names, ``named(flags)`` the command line's. The text may name other options too,
    each written ``mention(name)``."""

    def __init__(self, names: str | Sequence[str], text: str) -> None:  # names: () when the text mentions them
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.text = text
        super().__init__(self.named({}))

    def __reduce__(self) -> tuple:  # pickled whole (torchrun's ranks share a rank's error)
        return type(self), (self.names, self.text)

    def named(self, flags: Mapping[str, str]) -> str:
        """The message with each option called by flags[name] (a name not in flags: as is)."""
        called = [flags.get(n, n) for n in self.names]
        text = _MENTION.sub(lambda m: flags.get(m[1], m[1]), self.text)
        if not called:  # the options are named within the text
            return text
        joined = called[0] if len(called) == 1 else f"{', '.join(called[:-1])} and {called[-1]}"
        return joined + (text if text[:1] in (":", ",", ";") else f" {text}")


class OptionExists(OptionError, FileExistsError):
    """An output in the way of an option's value (out), named as the caller names it."""


_MENTION = re.compile("\0([A-Za-z_]+)\0")


def mention(name: str) -> str:
    """Another option named inside an OptionError's text, called as the caller calls it."""
    return f"\0{name}\0"


@dataclass(frozen=True)
class Option:
    """What one field of an options dataclass is.

    Args:
        help: one line for ``--help`` and the generated docstring.
        kind: the values it takes (KIND_WORDS' keys; "?" after it: or None).
        choices: the values allowed, where they are few (taken from the policy's constants).
        at_least: the smallest value allowed.
        at_most: the largest value allowed (a share: at_least=0, at_most=1).
        name: the option's name where it differs from the field's (Hub.name is config_name).
        flag: the command line's flag where it differs from --name-with-dashes (task is --target);
            an option on by default and given a flag is turned off by it (progress: --quiet).
        flag_help: that flag's help where it is not the option's (--quiet: no progress bar).
        convert: instead of the kind's check: takes (name, value), returns the value kept.
        group: the field holds a dataclass of options: on the command line its own options' flags.
        python_flat: a group that Python callers also give option by option (split=, not hub=).
        from_file: whether a --config file may give it; False for what decides which code runs or what
            is deleted (trust_remote_code, overwrite): a file is data, never authority.
        writes: for a path a run reads where it exists and writes where nothing is there yet, what it
            writes there (factors: "the factors it fits"): a --config file may name only one that exists,
            since where a run writes is the command line's alone (as --out).
        required: the command line must give it (an option of a command without a Python API).
        many: the command line takes one or more values after the flag (--checkpoints A B C).
        positional: given by place on the command line, not by a flag (report's LABEL=SCORES ...).
        metavar: the value's name in --help where the flag's own is not the clearest (FILE, I/N).
        parse: the command line's reading of the text given (Shard.parse), instead of the kind's; a
            ValueError it raises is the flag's error.
        one_of: the name of a set of options of which the command line takes one at most (exactly one
            where they are required): select's --fraction or --count.
    """

    help: str = ""
    kind: str = "str"
    choices: tuple[str, ...] | None = None
    at_least: float | None = None
    at_most: float | None = None
    name: str | None = None
    flag: str | None = None
    flag_help: str | None = None
    convert: Callable[[str, Any], Any] | None = None
    group: bool = False
    python_flat: bool = False
    from_file: bool = True
    writes: str | None = None
    required: bool = False
    many: bool = False
    positional: bool = False
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    one_of: str | None = None


def option(default: Any, help: str = "", **what: Any) -> Any:
    """A dataclass field that is an option (Option's arguments as keywords)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **what)})


def share(default: float, help: str, **what: Any) -> Any:
    """An option that is a share or a probability: a number from 0 to 1."""
    return option(default, help, kind="float", at_least=0, at_most=1, **what)


@dataclass(frozen=True)
class Declared:
    """One option as the outside sees it: its name, its field, what it is, and its group's field
    (None at the top)."""

    name: str
    field: dataclasses.Field
    option: Option
    group: dataclasses.Field | None = None

    @property
    def flag(self) -> str:
        """How the command line gives it: its flag, or its name for a positional option."""
        if self.option.positional:
            return self.name
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        return self.field.default


def declared(cls: type, python: bool = False) -> Iterator[Declared]:
    """cls's options in order, each group's own options in its place (on the command line; for Python
    only a python_flat group's): what a flag parser or a signature lists."""
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        if opt.group and (opt.python_flat or not python):
            for inner in declared(type(f.default), python):
                yield dataclasses.replace(inner, group=f)
        else:
            yield Declared(opt.name or f.name, f, opt)


def typed(name: str, value: Any, kind: str) -> Any:
    """value, if it is of kind (KIND_WORDS; with "?" after it, None too), in the form a run keeps: an
    integral number (not a bool) as an int, a path as a str, a list of str joined by commas, a
    torch.device as its name; else a TypeError that names the parameter as Python code passes it."""
    optional, kind = kind.endswith("?"), kind.rstrip("?")
    if value is None and optional:
        return None
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "int" and number and isinstance(value, numbers.Integral):
        return int(value)
    if kind == "float" and number:
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "pairs":
        return pairs(name, value)
    if kind not in ("int", "float", "bool") and isinstance(value, str):
        return value
    if kind == "path" and isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return os.fspath(value)
    if kind == "strs" and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if kind == "device" and type(value).__name__ == "device":  # a torch.device, without importing torch here
        return str(value)
    raise TypeError(f"{name} must be {KIND_WORDS[kind]}{' or None' if optional else ''}, got "
                    f"{type(value).__name__} {reprlib.repr(value)}")


_PYTHON_LITERALS = {"True": True, "False": False, "None": None}  # "False" kept as text would be true


def pairs(name: str, value: Any) -> dict[str, Any]:
    """A "pairs" option's dict: as given (str keys), or from KEY=VALUE strings (as the command line gives
    them; one such str alone too), each VALUE read as JSON where it is (4, 1e-4, true, ["a"]), as Python's
    True, False or None, and as text where not (cosine)."""
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return dict(value)
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        out: dict[str, Any] = {}
        for item in value:
            key, equals, text = item.partition("=")
            if not equals or not key:
                raise OptionError(name, f"{item!r}: expected KEY=VALUE")
            try:
                out[key] = _PYTHON_LITERALS[text] if text in _PYTHON_LITERALS else json.loads(text)
            except ValueError:
                out[key] = text
        return out
    raise TypeError(f"{name} must be {KIND_WORDS['pairs']}, got {type(value).__name__} {reprlib.repr(value)}")


def check_options(obj: Any) -> None:
    """Each option field of a frozen dataclass checked and kept in its plain form (in __post_init__):
    its type (or its convert), its choices and its bound, each error naming the parameter."""
    for f in dataclasses.fields(obj):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        name = f.name  # as the dataclass's own constructor names it
        value = getattr(obj, f.name)
        if opt.convert is not None:
            value = opt.convert(name, value)
        elif opt.group:
            value = group_value(name, value, type(f.default))
        else:
            value = typed(name, value, opt.kind)
        if isinstance(value, float) and not math.isfinite(value):
            raise OptionError(name, f"must be a finite number, got {value}")
        if opt.choices is not None and value is not None and value not in opt.choices:
            raise OptionError(name, f"must be one of {', '.join(map(str, opt.choices))}, got {value!r}")
        low, high = opt.at_least, opt.at_most
        if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
            raise OptionError(name, f"must be at least {low:g}, got {value}" if high is None else
                              f"must be between {low:g} and {high:g}, got {value}")
        object.__setattr__(obj, f.name, value)


def group_value(name: str, value: Any, cls: type) -> Any:
    """A group's value: one of cls, or a dict of its fields' names (as a manifest writes it)."""
    if isinstance(value, Mapping):
        kinds = {f.name: f.metadata["option"].kind for f in dataclasses.fields(cls) if "option" in f.metadata}
        unknown = [k for k in value if k not in kinds]
        if unknown:
            raise TypeError(f"{name} has no field {unknown[0]!r}: a dict's keys are {cls.__name__}' fields "
                            f"({', '.join(kinds)})")
        return cls(**{k: typed(f"{name}.{k}", v, kinds[k]) for k, v in value.items()})
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__} "
                        f"{reprlib.repr(value)}")
    return value


def split_options(options: Mapping[str, Any], *classes: type, caller: str) -> list[dict[str, Any]]:
    """Python keyword arguments as each class's fields (a python_flat group's gathered into it); a name
    none of them has is a TypeError that says the nearest."""
    parts: list[dict[str, Any]] = []
    known: set[str] = set()
    for cls in classes:
        part: dict[str, Any] = {}
        for d in declared(cls, python=True):
            known.add(d.name)
            if d.name not in options:
                continue
            if d.group is None:
                part[d.field.name] = options[d.name]
            else:  # checked here, where the caller's name for it is known
                part.setdefault(d.group.name, {})[d.field.name] = typed(d.name, options[d.name], d.option.kind)
        parts.append(part)
    unknown = [k for k in options if k not in known]
    if unknown:
        near = nearest(unknown[0], sorted(known))
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {near!r}?)" if near else ""))
    return parts


def nearest(word: str, names: Sequence[str], edits: int = 2) -> str | None:
    """The name a mistyped word most likely meant, at most edits away (a swap of neighbours is one
    edit): every "did you mean" of the package, so that each suggests alike."""
    from rapidfuzz import process
    from rapidfuzz.distance import DamerauLevenshtein

    near = process.extractOne(word, names, scorer=DamerauLevenshtein.distance, score_cutoff=edits)
    return near[0] if near else None


def expose(func: Callable, *classes: type) -> None:
    """Gives func (which takes ``**options``) each class's Python options but its own parameters:
    as keyword-only parameters in its signature, with their types and defaults, and as an
    ``Options:`` section (indented as a docstring's body) with their help and default."""
    own = [p for p in inspect.signature(func).parameters.values() if p.kind != p.VAR_KEYWORD]
    taken = {p.name for p in own}
    extra, lines = [], ["", "    Options (keyword-only; gradspec.options declares them):"]
    for cls in classes:
        for d in declared(cls, python=True):
            if d.name in taken:
                continue
            taken.add(d.name)
            extra.append(inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, annotation=d.field.type,
                                           default=d.default))
            shown = "" if "default" in d.option.help else f" (default: {d.default!r})"
            lines.append(textwrap.fill(f"{d.name}: {d.option.help}{shown}", 100, initial_indent=" " * 8,
                                       subsequent_indent=" " * 12))
    func.__signature__ = inspect.signature(func).replace(parameters=own + extra)  # type: ignore[attr-defined]
    func.__doc__ = (func.__doc__ or "") + "\n".join(lines) + "\n"
