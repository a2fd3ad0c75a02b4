"""What this machine gives gradspec, for bug reports (`gradspec env`): which paths can run (the C++
extension and the LAPACK it is bound to, Triton, CuPy, CUDA devices), the CPU, the threads, the versions."""

from __future__ import annotations

import os
import platform
import sys
import types
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from gradspec.exports import deprecated
from gradspec.runs.numerics import cpu

CUPY = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")  # CuPy's wheels are named by CUDA major version
PACKAGES = ("gradspec", "torch", "transformers", "numpy", "scipy", "triton", *CUPY, "nvmath-python", "datasets",
            "peft", "pyarrow", "accelerate", "gguf")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


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
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (libgomp spins, then sleeps)",
                    "blas": [{"library": b["internal_api"], "version": b.get("version"),
                              "threads": b["num_threads"]} for b in threadpool_info()]},
        "cpu": cpu(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {p: v for p in PACKAGES if (v := _version(p)) is not None},
    }


class _CallableForOneRelease(types.ModuleType):
    """gradspec.environment was the function until this release: calling the module still runs it,
    with a DeprecationWarning (the module and the function no longer share the name gradspec.environment)."""

    def __call__(self) -> dict[str, Any]:
        deprecated("calling gradspec.environment", "call gradspec.environment.environment() (or run `gradspec env`)")
        return environment()


sys.modules[__name__].__class__ = _CallableForOneRelease
