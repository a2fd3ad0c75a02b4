"""`--config FILE`: a command's options from a YAML or JSON file (keys are the flags' names, with or
without the dashes), or a run's own record: a run folder's manifest.json or a score file (whose
metadata holds the same) replays that run. Flags given on the command line override the file.

A file is data, never authority: it sets what a run computes and how, never where the output goes
or what runs code or deletes (--out, --overwrite, --trust-remote-code: the command line's alone),
since a run's record can be crafted, and replaying one is what the docs teach. A path a run reads
where it exists and writes otherwise (--factors) a file may give only where it exists, to be read."""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradspec.cli.options import run_flags
from gradspec.files import NotRegularFile, read_text, regular
from gradspec.options import declared


def run_options(config: Any, recorded: Collection[str]) -> dict[str, Any]:
    """A run's config (a ScoreConfig) as the options of the command that started it, by the flags'
    names: those its record holds (describe leaves out what did not apply to the run, e.g. rank without lowrank)."""
    return run_flags(asdict(config), type(config), recorded)


def _model_found(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its model as found from here: a model folder given by a path relative to where
    that run started (not found from here) is the folder the record says it resolved to, where that
    still holds it (a Hub id, resolved into the Hub's cache, and the default model stay as named)."""
    from gradspec.data.models import DEFAULT_MODEL

    model, folder = record.get("model"), record.get("model_path")
    if not isinstance(model, str) or not isinstance(folder, str) or model == DEFAULT_MODEL or Path(model).exists() or \
            Path(model).is_absolute() or "models--" in folder or not Path(folder).is_dir():
        return record
    return {**record, "model": folder}


def _read(path: Path) -> dict[str, Any]:
    what = "pass a YAML or JSON file, a run's manifest.json or a score file"
    try:
        regular(path, what)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file; {what}") from None
    except NotRegularFile as e:  # a FIFO would block the read past any signal
        raise ValueError(f"--config {e}") from None
    if path.suffix == ".parquet":
        from gradspec.runs.score_files import read_metadata

        raw = read_metadata(path)
        if not raw:
            raise ValueError(f"--config {path}: a Parquet file without gradspec's metadata (not a score file)")
        return raw
    text = read_text(path)
    if path.suffix == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path}:{e.lineno}: malformed JSON: {e.msg}") from None
    else:
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            raise ValueError(f"--config {where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got {type(raw).__name__}")
    return raw


def config_values(path: str | Path, parser: argparse.ArgumentParser, command: str,
                  command_line: Collection[str] = ()) -> dict[str, Any]:
    """The file's options as parser defaults, each checked as its flag would be. command_line: the dests
    the command line gives (whose values win over the file's)."""
    path = Path(path)
    raw = _read(path)
    is_run = "version" in raw and isinstance(raw.get("fields"), dict)  # describe's output: a manifest or a score file
    if is_run:
        from gradspec.runs.config import ScoreConfig  # a run's record: only the commands that start runs read one

        try:
            raw = run_options(ScoreConfig.from_manifest(_model_found(raw)), recorded=raw.keys())
        except (TypeError, ValueError) as e:  # a record edited by hand
            raise ValueError(f"--config {path}: not a run's record as gradspec writes it: {e}") from None
    by_dest = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    by_flag = {o.lstrip("-").replace("-", "_"): a for a in by_dest.values() for o in a.option_strings}
    values, written = {}, _written_paths()
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        action = by_dest.get(name) or by_flag.get(name)
        if action is not None and action.dest in _command_line_only():
            raise ValueError(f"--config {path}: {key!r} is taken from the command line only, never from a file "
                             f"(a file sets what a run computes, not where it writes, what it deletes or what code "
                             f"it runs): drop it from the file and pass {action.option_strings[0]} if you mean it")
        if action is None:
            hint = " (this run's record is another command's: replay it with that one)" if is_run else ""
            raise ValueError(f"--config {path}: {key!r} is not an option of gradspec {command}{hint}")
        as_flag = name not in by_dest  # e.g. no_merge: true, for the dest merge
        value = _value(action, value, f"--config {path}: {key}", as_flag)
        if action.dest in written and action.dest not in command_line and value is not None and \
                not Path(value).exists():
            raise ValueError(f"--config {path}: {key!r}: {value}: no such file; a file may name one for the run to "
                             "read, never one for it to write (where a run writes is the command line's alone): "
                             f"pass {action.option_strings[0]} on the command line to have it write "
                             f"{written[action.dest]} there")
        if not (is_run and value == action.default):  # a run's record gives only what differs from the defaults
            values[action.dest] = value
    return values


def _command_line_only() -> set[str]:
    """The dests no file may give: the output, and the options declared from_file=False."""
    from gradspec.runs.config import RunSettings, ScoreConfig

    return {"out"} | {d.name for cls in (ScoreConfig, RunSettings) for d in declared(cls) if not d.option.from_file}


def _written_paths() -> dict[str, str]:
    """dest -> what a run writes there where nothing is there yet, of the options declared with writes: a
    file may name only a path that exists."""
    from gradspec.runs.config import RunSettings, ScoreConfig

    return {d.name: d.option.writes for cls in (ScoreConfig, RunSettings) for d in declared(cls) if d.option.writes}


def _value(action: argparse.Action, value: Any, where: str, as_flag: bool) -> Any:
    if action.nargs == 0:  # a switch: its dest's value, or named by its flag, whether it is given
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return (action.const if value else action.default) if as_flag else value
    if value is None and action.default is not None:
        raise ValueError(f"{where}: expected a value, got null (leave the key out for the default, "
                         f"{action.default!r})")
    if value is None:
        return None
    if isinstance(value, (dict, list, bool)):
        raise ValueError(f"{where}: expected a single value, got {value!r}")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{where}: {e}") from None
        except ValueError:
            raise ValueError(f"{where}: expected {getattr(action.type, '__name__', 'another value')}, "
                             f"got {value!r}") from None
    else:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value
