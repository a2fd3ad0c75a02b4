"""What a run records of itself: its config hashed (the fingerprint each part and the merged file record,
which a resume and a merge compare), the model's identity on disk (which the config holds), and the rows
each part holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gradspec.files import open_regular, read_text

MODEL_IDENTITY = ("model_path", "model_fingerprint")  # the model a run's config names, as found on disk
# The model's names, recorded and compared only where its fingerprint is not known: the same files under
# another name (./m for m, an absolute path, another node's copy) are the same model
RECORDED = ("model_path", "model")
# The input files' sizes: recorded, warned about when they change, not refused: fixing a malformed
# row (docs/inputs.md) changes its file, and the parts written before that row stay valid.
INPUT_SIZES = ("data_bytes", "task_bytes")
SHARDS = "shards"  # the manifest's record of how many --shard processes split the run
NUMERICS = "numerics"  # in the manifest: what the rows' last bits depend on beside the config (runs.numerics)
FINGERPRINT = "config_fingerprint"  # in each part's metadata (and the merged file's): the run's config, hashed
PART = "part"  # in each part's metadata: {"chunk", "first_row", "last_row"}
_MODEL_SUFFIXES = {".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".gguf", ".py", ".tiktoken"}
_SAMPLE = 1 << 16  # bytes read at each of a model file's start, middle and end for its fingerprint


def run_config(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's config: less its shard count, which a run may change."""
    return {k: v for k, v in manifest.items() if k != SHARDS}


def config_fingerprint(config: dict[str, Any]) -> str:
    """The run's config (a manifest, less its shard count, its input files' sizes and the model's
    names where its fingerprint is known) hashed: 16 hex digits."""
    names = RECORDED if config.get("model_fingerprint") is not None else ("model_path",)
    body = {k: v for k, v in config.items() if k not in (SHARDS, *names, *INPUT_SIZES)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model: str | None) -> dict[str, str] | None:
    """{"model_path": the model's folder, resolved; "model_fingerprint": a hash of its files' names,
    sizes and a few sampled blocks of each (no file is read whole)}, or None where the model is not
    on this machine yet (a Hub id not in the cache, the default model not converted yet). A PEFT
    adapter's fingerprint covers its base model's too. model: as given to --model (None: the default)."""
    folder = _model_folder(model)
    if folder is None:
        return None
    digest = hashlib.sha256()
    try:
        for f in sorted(folder.iterdir()):
            if f.name.startswith(".") or f.suffix not in _MODEL_SUFFIXES or not f.is_file():
                continue
            size = f.stat().st_size
            digest.update(f"{f.name}\0{size}\0".encode())
            with open_regular(f) as handle:
                for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                    handle.seek(at)
                    digest.update(handle.read(_SAMPLE))
        adapter = folder / "adapter_config.json"
        if adapter.is_file():
            base = json.loads(read_text(adapter)).get("base_model_name_or_path")
            inner = model_identity(base) if base else None
            if inner is None:
                return None
            digest.update(inner["model_fingerprint"].encode())
    except (OSError, ValueError):
        return None
    return {"model_path": str(folder), "model_fingerprint": digest.hexdigest()[:16]}


def _model_folder(model: str | None) -> Path | None:
    from gradspec.data.models import DEFAULT_MODEL, cache_dir, names_default

    if names_default(model):  # None, or the default's name: the same weights, the same identity
        converted = cache_dir() / DEFAULT_MODEL
        return converted.resolve() if (converted / "config.json").is_file() else None
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    try:  # a Hub id: its snapshot in the local cache (the folder names the commit)
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001  (not an id the cache knows: no identity yet)
        return None
    return Path(found).parent if isinstance(found, str) else None
