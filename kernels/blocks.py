"""The block sizes each kernel launches with, per GPU architecture: one table, which the launchers read
(by their tensors' device) and which benchmarks/gpu/gpu_static.py compiles and checks for every architecture
it names (registers, spills, shared memory, occupancy: the table in benchmarks/RESULTS.md).

The choice, per kernel and architecture, is gpu_static.py's rule on those static numbers: of the
candidate blocks 16, 32 and 64 (the same for each block argument), the largest at which every input dtype
and flag of the kernel's main path compiles without register spills, within the architecture's
shared memory per block, and at an occupancy of at least a quarter of the SM's warps (four warps per
scheduler to hide memory latency). At block 64 the SYRK and the Gram spill on all three (255 registers)
and the A^T B on sm_80, and on sm_90/sm_100 the A^T B holds 64 KiB of shared memory a block, 19%
occupancy; at 32 every launch compiles without a spill at 25-81%: 32 everywhere. Static numbers rule
blocks out, they cannot rank the rest (16 passes too): a change here is for a timing on the GPU
(benchmarks/gpu/gpu_suite.py times exactly these blocks) to justify.
"""

from __future__ import annotations

from functools import cache

import torch

_BLOCK_32 = {
    "segment_syrk64": {"block_t": 32, "block_d": 32},
    "segment_gram": {"block_t": 32, "block_d": 32},
    "segment_tdot": {"block_t": 32, "block_p": 32, "block_q": 32},
}
# Compute capability (major * 10 + minor) -> kernel -> its launcher's block arguments.
BLOCKS: dict[int, dict[str, dict[str, int]]] = {
    80: _BLOCK_32,  # A100
    90: _BLOCK_32,  # H100, H200
    100: _BLOCK_32,  # B200
}
# Any other device (another GPU, the CPU under TRITON_INTERPRET=1): block 32 needs at most 40 KiB of shared
# memory, within the 99 KiB per block of the consumer parts (sm_86, sm_89, sm_120).
ELSEWHERE = _BLOCK_32


@cache
def architecture(index: int) -> int:
    """The compute capability of CUDA device index, as major * 10 + minor (9.0 -> 90)."""
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def blocks(kernel: str, device: torch.device, **given: int | None) -> dict[str, int]:
    """The block arguments kernel launches with on device: its architecture's row of BLOCKS, else ELSEWHERE's;
    a block given (not None) in place of the table's; in the launcher's argument order."""
    if device.type != "cuda":
        table = ELSEWHERE[kernel]
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        table = BLOCKS.get(architecture(index), ELSEWHERE)[kernel]
    return {name: given.get(name) or block for name, block in table.items()}
