"""Triton kernels, each next to the torch reference it is tested against. They import nothing else of
gradspec (linalg calls them: tests/test_imports.py), so each reference masks padding itself.

This folder is gradspec.kernels (setup.py's package_dir). Where the repository's root is on sys.path
(`python -m` or a script started there), `import kernels` finds it first, before Hugging Face's
`kernels` distribution that transformers (5.25 on) imports: imported under that name, it hands the
name over to the installed distribution (or fails as a missing module would).
"""

import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels' (the repository's kernels/ folder is gradspec.kernels)",
                                  name="kernels")
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
