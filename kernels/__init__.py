"""Triton kernels, each next to the torch reference it is tested against. They import nothing else of
gradspec (linalg calls them: tests/test_imports.py), so each reference masks padding itself.

This folder is gradspec.kernels (setup.py's package_dir). Where the repository's root is on sys.path
(`python -m` or a script started there), `import kernels` finds it first, before Hugging Face's
`kernels` distribution that transformers (5.25 on) imports: imported under that name, it hands the
name over to that distribution where one is installed, and is this folder where none is (as transformers
before 5.25 found it).
"""

import importlib.machinery
import os
import sys


def _installed_elsewhere() -> importlib.machinery.ModuleSpec | None:
    """Hugging Face's `kernels`: a top-level `kernels` anywhere on sys.path but the repository's root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != root])
    return spec if spec is not None and spec.loader is not None else None


if __name__ == "kernels" and (_spec := _installed_elsewhere()) is not None:
    import importlib.util

    _installed = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _installed  # what `import kernels` returns once this file has run
    _spec.loader.exec_module(_installed)
else:
    from .jacobi_eigvalsh import jacobi_eigvalsh_triton
    from .segment_gram import segment_gram_torch, segment_gram_triton, triton
    from .segment_syrk64 import segment_syrk64_torch, segment_syrk64_triton
    from .segment_tdot import segment_tdot_torch, segment_tdot_triton

    __all__ = ["jacobi_eigvalsh_triton", "segment_gram_torch", "segment_gram_triton", "segment_syrk64_torch",
               "segment_syrk64_triton", "segment_tdot_torch", "segment_tdot_triton", "triton"]
