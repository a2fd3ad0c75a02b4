"""A package's public names, each imported from the module that defines it on first use (PEP 562), so
that `import gradspec` loads neither torch, pandas nor transformers; and the names that moved, which
keep working for one release with a DeprecationWarning that names their new import."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def deprecated(old: str, advice: str, stacklevel: int = 3) -> None:
    """Warns that old (a dotted name) goes in the next release, and what to use instead."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release: {advice}", DeprecationWarning,
                  stacklevel=stacklevel)


def _load(where: str) -> Any:
    """The object at "module:attribute", or the module itself where no attribute is named."""
    module, _, attribute = where.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def lazy_names(package: str, exports: Mapping[str, str], moved: Mapping[str, tuple[str, str]] | None = None
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Args:
        package: The package's ``__name__``.
        exports: Each public name -> "module:attribute" that defines it ("module" alone: the
            attribute of the same name). Loaded once, then kept in the package's namespace.
        moved: Each old name -> ("module:attribute" it still resolves to, what to use instead):
            resolved on every use, with a DeprecationWarning naming the new import.

    Returns:
        (__getattr__, __dir__), to assign in the package's ``__init__``.
    """
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        if name in exports:
            where = exports[name]
            value = _load(where if ":" in where else f"{where}:{name}")
            setattr(sys.modules[package], name, value)  # once: later lookups do not come here
            return value
        if name in moved:
            where, advice = moved[name]
            deprecated(f"{package}.{name}", advice)
            return _load(where)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
