"""How the linear algebra runs: the precision is configuration, the path of each stage is forced or measured.

Precision is never chosen by a timing. "fp64" (the default: exact mode) forms every Gram, core
and sketch product in fp64 on every path (on a GPU, Triton's segment SYRK reads the activations in
their dtype and accumulates in fp64), so any two paths agree to fp64 rounding. "fp32" forms
them with fp32 accumulation (the Triton kernels, or torch in fp32), for speed on GPUs whose fp64
is slow; its eigenvalue cut-offs use fp32's epsilon. Eigenproblems are solved in fp64 in both.

Within a precision, each stage (``STAGES``) runs one of its paths: the one ``force`` or
``backend`` names, else on a GPU the fastest measured (gradspec.linalg.dispatch), else a fixed
preference. Every path taken is recorded in ``used``, which the score file's metadata carries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from gradspec.choices import BACKENDS
from gradspec.choices import PRECISIONS as PRECISION_NAMES

PRECISIONS: dict[str, torch.dtype] = dict(zip(PRECISION_NAMES, (torch.float64, torch.float32), strict=True))
STAGES = ("segment_gram", "product_gram", "segment_tdot", "core", "gram")


@dataclass
class Policy:
    """precision: "fp64" or "fp32"; backend: "cpp" or "torch" force that path wherever a stage
    has it ("auto": none); force: {stage: path} for single stages (tests, the GPU acceptance run)."""

    precision: str = "fp64"
    backend: str = "auto"
    force: dict[str, str] = field(default_factory=dict)
    used: dict[str, set[str]] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto', 'cpp' or 'torch', got {self.backend!r}")
        unknown = set(self.force) - set(STAGES)
        if unknown:
            raise ValueError(f"force names unknown stages {sorted(unknown)}; stages are {STAGES}")

    @classmethod
    def of(cls, policy: Policy | str) -> Policy:
        """A Policy as given, or the default precision with this backend."""
        return policy if isinstance(policy, Policy) else cls(backend=policy)

    @property
    def dtype(self) -> torch.dtype:
        """What the Grams and sketch products accumulate in."""
        return PRECISIONS[self.precision]

    @property
    def eps(self) -> float:
        """The epsilon of the eigenvalue cut-offs: the Grams' own rounding."""
        return torch.finfo(self.dtype).eps

    def wanted(self, stage: str, paths: list[str]) -> str | None:
        """The path forced for this stage among those it has, or None."""
        name = self.force.get(stage)
        if name is None and self.backend != "auto" and self.backend in paths:
            name = self.backend
        if name is not None and name not in paths:
            raise ValueError(f"the {stage} stage has no {name!r} path here (it has {paths}; precision "
                             f"{self.precision})")
        return name

    def record(self, stage: str, path: str) -> None:
        with self._lock:
            self.used.setdefault(stage, set()).add(path)

    def describe(self) -> dict[str, Any]:
        """For the results' metadata: the precision and the paths each stage took."""
        with self._lock:
            return {"precision": self.precision, "paths": {s: sorted(p) for s, p in sorted(self.used.items())}}
