"""Whether a recorded config (a run's manifest, a part's or the merged file's metadata) is this run's,
and if not, what differs, said as the options that differ and how to continue."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gradspec.files import regular
from gradspec.options import OptionError, mention
from gradspec.runs.run_folder.fingerprints import INPUT_SIZES, NUMERICS, RECORDED, SHARDS
from gradspec.runs.score_files import schema_metadata


def as_json(config: dict[str, Any]) -> dict[str, Any]:
    """config as its manifest holds it (tuples as lists, ...), so that both compare equal."""
    return json.loads(json.dumps(config, default=str))


def differences(recorded: dict[str, Any], config: dict[str, Any], keys: set[str], where: str, here: str) -> list[str]:
    """'key: value where, value here' for each of keys whose value differs between a recorded config
    and this one, less what a run may change (its shard count, its input files' sizes) and the model's
    names while its fingerprint is the same; each key mentioned (an OptionError names it as its
    caller does: --target on the command line for the record's task)."""
    return [f"{mention(k)}: {recorded.get(k)!r} {where}, {config.get(k)!r} {here}"
            for k in sorted(keys - {SHARDS, *INPUT_SIZES}) if recorded.get(k) != config.get(k)
            and (k not in RECORDED or _other_model(recorded, config))]


def refuse_other_config(folder: Path, old: dict[str, Any], config: dict[str, Any],
                        unknown: tuple[str, ...] = ()) -> None:
    """OptionError where the run in folder (its manifest, old) is not of config (less the keys unknown
    yet): its numerics alone (how to continue it bit for bit), or its options."""
    config = as_json(config)
    found = differences(old, config, (set(old) | set(config)) - set(unknown), "in the run", "now")
    if found and found == differences(old, config, {NUMERICS}, "in the run", "now"):
        raise OptionError((), f"cannot continue the run in {folder} bit for bit: " + found[0] + "; "
                          + _match(old.get(NUMERICS), config.get(NUMERICS)) + f", or pass {mention('overwrite')} "
                          "to start again")
    if found:
        raise OptionError((), f"cannot continue the run in {folder}, its config differs: "
                          + "; ".join(found) + f"; pass {mention('overwrite')} to start again with the "
                          "new config")


def recorded_config(out: Path) -> dict[str, Any] | str:
    """What a merged file records of its run, or why it records nothing readable."""
    try:
        recorded = schema_metadata(pq.read_schema(regular(out)))
    except (pa.ArrowException, OSError, ValueError) as e:
        return f"not a score file gradspec wrote ({' '.join(str(e).split())})"
    return recorded if isinstance(recorded, dict) else "its gradspec metadata is not a mapping"


def out_differences(out: Path, config: dict[str, Any], unknown: tuple[str, ...]) -> list[str]:
    """How the merged file at out differs from config (less the keys unknown yet), or why it is none."""
    recorded = recorded_config(out)
    if isinstance(recorded, str):
        return [recorded]
    config = as_json(config)
    keys = set(config) - set(unknown) - {NUMERICS}  # a finished file is this run's whatever threads made it
    return differences(recorded, config, keys, "in the file", "now")


def _match(recorded: Any, now: Any) -> str:
    """How to continue a run under the numerics it recorded (what its rows' last bits depend on)."""
    recorded, now = recorded if isinstance(recorded, dict) else {}, now if isinstance(now, dict) else {}
    ways = []
    for key in sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k)):
        value = recorded.get(key)
        if key == "threads":
            ways.append(f"its parts were computed with {value} thread{'s' * (value != 1)} (torchrun sets "
                        f"OMP_NUM_THREADS=1): run with OMP_NUM_THREADS={value}")
        elif key == "batch_tokens":
            ways.append(f"its parts were cut into batches of at most {value} tokens: pass "
                        f"{mention('batch_tokens')} {value}")
        else:
            ways.append(f"it ran with {key} {value!r}: run with the same")
    return "; ".join(ways) + " to continue it"


def _other_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records may name other models: their fingerprints differ, or one is not known."""
    return a.get("model_fingerprint") is None or a.get("model_fingerprint") != b.get("model_fingerprint")
