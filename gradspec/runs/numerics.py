"""What a run's rows' last bits depend on beside its config (its numerics): recorded in its manifest
and score file, matched by a resume or a joining shard (gradspec.runs.run_folder)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any


def cpu(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model and the vector units its fp32 and fp64 rates depend on (AVX-512, AMX): the
    same run's ratio to its floor differs between CPU models, so every figure names it."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8")
    except OSError:
        return {"model": platform.processor() or None}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name"), "avx512": "avx512f" in flags, "amx": "amx_tile" in flags}


def numerics(device: str, batch_tokens: int) -> dict[str, Any]:
    """What decides a run's last bits beside its config: torch's version and intra-op threads (how its
    GEMMs split their sums), the CPU (the kernels torch and MKL pick for it), the GPU, and the batch
    size in tokens (a GEMM's shape picks its kernel). The same config under other numerics gives rows
    that differ in the last bits, so a run records them and a resume or a joining shard must match
    them (gradspec.runs.run_folder)."""
    import torch

    found = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu().get("model"),
             "batch_tokens": batch_tokens}
    if device.startswith("cuda") and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return found
