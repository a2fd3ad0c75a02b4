"""The layer kinds gradspec can score, one small module each (linear.py, conv1d.py), registered here.

A kind recognises its modules and says their weight's shape: supporting a new layer type is one
new file with one registered function (the per-sample gradient is always D^T X from the module's
input X and output gradient D, so nothing else needs to know the kind).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn


class Shape(NamedTuple):
    d_in: int
    d_out: int
    transposed: bool  # the weight is stored as (d_in, d_out)


LAYER_KINDS: list[Callable[[nn.Module], Shape | None]] = []


def register(kind: Callable[[nn.Module], Shape | None]) -> Callable[[nn.Module], Shape | None]:
    LAYER_KINDS.append(kind)
    return kind


def shape_of(module: nn.Module) -> Shape | None:
    """The weight shape of a module some registered kind recognises, else None."""
    for kind in LAYER_KINDS:
        shape = kind(module)
        if shape is not None:
            return shape
    return None
