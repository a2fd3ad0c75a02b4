"""The C++ eigen stage vs torch.linalg.eigvalsh: a batch of 120 symmetric PSD matrices (a 7B
model's q/k/v/o count per sample is 112-128) at n = 64, 128, 256, fp64, this machine's threads.

Run with ``pytest benchmarks/throughput/bench_eigen.py -s``; the ratios print at the end.
"""

import pytest
import torch

from benchmarks.common import MEDIANS
from gradspec.linalg import eigen, extension

SIZES = (64, 128, 256)
BATCH = 120

pytestmark = pytest.mark.skipif(not extension.BUILT, reason="gradspec._C not built")


def _grams(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    Y = torch.randn(BATCH, n, 2 * n, generator=g, dtype=torch.float64)
    return Y @ Y.transpose(1, 2)


@pytest.mark.parametrize("n", SIZES)
def test_torch_eigvalsh(n, record):
    grams = _grams(n)
    record(f"torch-{n}", lambda: torch.linalg.eigvalsh(grams), rounds=7)


@pytest.mark.parametrize("n", SIZES)
def test_cpp_gram_spectra(n, record):
    grams = _grams(n)
    record(f"cpp-{n}", lambda: eigen.gram_spectra(grams, "cpp"), rounds=7)


def test_report_ratios():
    rows = [n for n in SIZES if {f"torch-{n}", f"cpp-{n}"} <= MEDIANS.keys()]
    if not rows:
        pytest.skip("run the whole file")
    for n in rows:
        t, c = MEDIANS[f"torch-{n}"], MEDIANS[f"cpp-{n}"]
        print(f"\nn={n}: torch eigvalsh {t * 1e3:.1f} ms, C++ (eigenvalues + all metrics) {c * 1e3:.1f} ms, "
              f"{t / c:.2f}x (target >= 1.5x)")
