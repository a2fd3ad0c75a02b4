"""What this machine gives gradspec, for bug reports (`gradspec env`): which paths can run (the C++
extension and the LAPACK it is bound to, Triton, CuPy, CUDA devices), the CPU, the threads, the versions."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

CUPY = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")  # CuPy's wheels are named by CUDA major version
PACKAGES = ("gradspec", "torch", "transformers", "numpy", "scipy", "triton", *CUPY, "nvmath-python", "datasets",
            "peft", "pyarrow", "accelerate", "gguf")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


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


def environment() -> dict[str, Any]:
    """The paths, devices, threads and versions, as plain values.

    Returns:
        A JSON-ready dict: "cpp_extension", "triton", "cupy", "cuda" (its devices), "threads",
        "cpu", "python", "platform" and "versions" (of the installed packages among PACKAGES).
    """
    import scipy.linalg  # noqa: F401  (loads SciPy's BLAS, so threadpoolctl can see it)
    import torch  # here: `import gradspec` stays light
    from threadpoolctl import threadpool_info

    from gradspec.kernels import triton
    from gradspec.linalg import extension

    devices = [{"index": i, "name": torch.cuda.get_device_name(i),
                "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(i)),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
               for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None  # Linux only
    return {
        "cpp_extension": {"built": extension.BUILT, "lapack": extension.LAPACK},
        "triton": {"importable": triton is not None, "interpreter": os.environ.get("TRITON_INTERPRET") == "1"},
        "cupy": next(filter(None, map(_version, CUPY)), None),
        "cuda": {"torch_built_with": torch.version.cuda, "available": torch.cuda.is_available(), "devices": devices},
        "threads": {"cpus": os.cpu_count(), "usable_cpus": usable,
                    "torch_intra_op": torch.get_num_threads(), "torch_inter_op": torch.get_num_interop_threads(),
                    "extension": extension.default_threads(),
                    "blas": [{"library": b["internal_api"], "version": b.get("version"),
                              "threads": b["num_threads"]} for b in threadpool_info()]},
        "cpu": cpu(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {p: v for p in PACKAGES if (v := _version(p)) is not None},
    }
