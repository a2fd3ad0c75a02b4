"""The C++ extension (gradspec._C), bound at import to the BLAS/LAPACK it calls.

``C`` is the extension module, or None when it is not built (``BUILT``). Its calls run their
own threads over the batch, so SciPy's BLAS is held at one thread meanwhile (ONE_BLAS_THREAD).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from gradspec.linalg.blas_threads import OneBlasThread


def _capsule_address(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(capsule, name(capsule))


def lapack_addresses(prefer_mkl: bool = True) -> dict[str, int]:
    """SciPy's BLAS/LAPACK, with dsyevd, dpotrf and dgemm from the MKL inside torch's CPU build
    where it exports them (the routines it exports; it has no dpstrf, dsyrk or dtrmm)."""
    from scipy.linalg import cython_blas, cython_lapack

    lapack, blas = cython_lapack.__pyx_capi__, cython_blas.__pyx_capi__
    found = {name: _capsule_address(caps[name]) for caps, name in
             ((lapack, "dsyevd"), (lapack, "dpstrf"), (lapack, "dpotrf"), (blas, "dgemm"), (blas, "dsyrk"),
              (blas, "dtrmm"))}
    if not prefer_mkl:
        return found
    try:
        torch_lib = Path(torch.__file__).parent / "lib"
        mkl = ctypes.CDLL(str(torch_lib / "libtorch_cpu.so"))
        # MKL_Set_Num_Threads_Local is the C entry (its argument by value); the lower-case
        # mkl_set_num_threads_local in this library is the Fortran one (by pointer).
        mkl_found = {
            "dsyevd": ctypes.cast(mkl.dsyevd_, ctypes.c_void_p).value,
            "dpotrf": ctypes.cast(mkl.dpotrf_, ctypes.c_void_p).value,
            "dgemm": ctypes.cast(mkl.dgemm_, ctypes.c_void_p).value,
            "mkl_set_num_threads_local": ctypes.cast(mkl.MKL_Set_Num_Threads_Local, ctypes.c_void_p).value,
        }
    except (OSError, AttributeError):
        return found
    return {**found, **mkl_found}


def _load() -> tuple[object | None, str | None]:
    """The extension with BLAS/LAPACK bound (or None when it is not built), and which library
    its eigensolver calls."""
    try:
        from gradspec import _C
    except ImportError:
        return None, None
    addresses = lapack_addresses()
    _C.bind_lapack(**addresses)
    with_mkl = "mkl_set_num_threads_local" in addresses
    return _C, "MKL in torch (dsyevd, dpotrf, dgemm), SciPy's for the rest" if with_mkl else "SciPy's BLAS/LAPACK"


C, LAPACK = _load()
BUILT = C is not None
ONE_BLAS_THREAD = OneBlasThread(ThreadpoolController() if BUILT else None)


def default_threads() -> int:
    """The extension's threads over the batch: GRADSPEC_THREADS, else torch's intra-op threads."""
    return int(os.environ.get("GRADSPEC_THREADS", 0)) or torch.get_num_threads()


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """t as the extension takes it: fp64, contiguous, on the host."""
    return t.detach().to("cpu", torch.float64).contiguous().numpy()
