"""Every Triton launch the dispatch can make: which kernel, reading which dtype, with which flags, at
which block sizes on each GPU architecture.

Read from the dispatch's own tables, not listed again: stages.PATHS says at which precision a stage
has a Triton path on a GPU, grams.TRITON_GRAM which kernel the segment Gram's path calls,
gradspec.choices.DTYPES the model dtypes that reach the segment Gram as they are (the sketch's products
are cast to the precision's dtype first: lowrank.sketch_gram), kernels.blocks.BLOCKS the block sizes per
architecture; the fp64 SYRK's FMA loop is the launch it falls back to where the fp64 dot fails to
compile. benchmarks/gpu/gpu_static.py compiles each launch for every architecture of BLOCKS,
tests/kernels/test_compile_for_gpus.py fails on one that does not compile cleanly, and
benchmarks/gpu/gpu_suite.py times each on the GPU: a new choice in any of those tables is compiled,
checked and timed with no other list to keep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from gradspec import kernels
from gradspec.choices import DTYPES
from gradspec.choices import PRECISIONS as PRECISION_NAMES
from gradspec.kernels import blocks as block_table
from gradspec.linalg import grams, stages
from gradspec.linalg.policy import PRECISIONS

# What a stage's path predicates are asked about: a tensor on a GPU (the launches are GPU launches).
_ON_GPU = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class TritonLaunch:
    """One launch: the stage and precision that make it, the dtype its input is read in, whether the
    segment Gram fuses <Gram, other>, and whether the fp64 SYRK sums with tl.dot (False: its FMA loop)."""

    stage: str
    precision: str
    dtype: torch.dtype
    other: bool = False
    dot: bool = True

    @property
    def launcher(self) -> Callable:
        """The kernels function the dispatch calls for this launch."""
        if self.stage == "segment_gram":
            return grams.TRITON_GRAM[self.precision]
        return kernels.segment_tdot_triton

    @property
    def kernel(self) -> str:
        """The kernel's name in kernels.blocks.BLOCKS (its module's)."""
        return self.launcher.__module__.rsplit(".", 1)[-1]

    @property
    def fallback(self) -> bool:
        """Whether this launch runs only where the main one failed to compile (the FMA loop)."""
        return not self.dot

    @property
    def label(self) -> str:
        """Unique among the launches: kernel/dtype[/other][/fma]."""
        return "/".join([self.kernel, SHORT[self.dtype]] + ["other"] * self.other + ["fma"] * (not self.dot))

    def blocks(self, arch: int | None) -> dict[str, int]:
        """The block arguments it launches with on arch (None: the device's own, as the dispatch leaves them)."""
        if arch is None:
            return {}
        return block_table.BLOCKS.get(arch, block_table.ELSEWHERE)[self.kernel]

    def inputs(self, N: int, T: int, d: int, k: int, device: torch.device | str,
               generator: torch.Generator | None = None) -> tuple:
        """Its arguments as the engine passes them: (Y, lengths, other or None) for a segment Gram of
        (N, T, d), (A, B, lengths) for A^T B of (N, T, d) and (N, T, k). Random with a generator (of
        device), else uninitialised (torch.empty: a meta device takes no memory)."""
        def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            if generator is None:
                return torch.empty(shape, dtype=dtype, device=device)
            return torch.randn(shape, generator=generator, device=device).to(dtype)

        lengths = torch.full((N,), T, device=device)
        wide = PRECISIONS[self.precision]
        if self.stage == "segment_gram":
            return make(N, T, d, dtype=self.dtype), lengths, make(N, T, T, dtype=wide) if self.other else None
        return make(N, T, d, dtype=self.dtype), make(N, T, k, dtype=self.dtype), lengths

    def run(self, *inputs: torch.Tensor | None, arch: int | None = None):
        """The launcher on inputs (self.inputs), at arch's blocks (None: the device's)."""
        options = self.blocks(arch) | ({} if self.dot else {"dot": False})
        return self.launcher(*inputs, **options)

    def reference(self, *inputs: torch.Tensor | None):
        """The stage's torch path on the same inputs, at the same precision (what the dispatch weighs it against)."""
        wide = PRECISIONS[self.precision]
        if self.stage == "segment_gram":
            return kernels.segment_gram_torch(*inputs, wide)
        return kernels.segment_tdot_torch(*inputs, wide)


def _has_triton(stage: str, precision: str) -> bool:
    return any(name == "triton" and exists(_ON_GPU, precision == "fp64") for name, exists in stages.PATHS[stage])


def triton_launches() -> list[TritonLaunch]:
    """Every launch, main paths first (each precision's, then the FMA fallbacks)."""
    launches = []
    for precision in PRECISION_NAMES:
        if _has_triton("segment_gram", precision):
            for name in DTYPES:
                for other in (False, True):
                    launches.append(TritonLaunch("segment_gram", precision, getattr(torch, name), other))
        if _has_triton("segment_tdot", precision):
            launches.append(TritonLaunch("segment_tdot", precision, PRECISIONS[precision]))
    fallbacks = [TritonLaunch(t.stage, t.precision, t.dtype, t.other, dot=False) for t in launches
                 if t.launcher is kernels.segment_syrk64_triton]
    return launches + fallbacks
