"""The extension runs its work on torch's own OpenMP threads, and leaves the caller's thread
settings as it found them."""

import ast
import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradspec.linalg import extension

pytestmark = pytest.mark.skipif(not extension.BUILT, reason="gradspec._C not built")


def _mapped_openmp_runtimes() -> set[str]:
    maps = Path("/proc/self/maps").read_text()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_in_the_process():
    """The extension's OpenMP is torch's library (libgomp.so.1, loaded by torch first): a second
    runtime would bring threads of its own, spinning beside torch's on the same cores (threads of
    the extension's own made its Grams take 1.9x as long inside a backward: benchmarks/RESULTS.md).
    In a process of its own: another library a test imported (faiss-cpu ships its own libgomp, which its
    index searches use) is that library's runtime, not the extension's."""
    code = ("import torch\nfrom pathlib import Path\nfrom gradspec.linalg import extension\n"
            "extension.C.segment_gram(torch.randn(2, 5, 3).numpy(), torch.tensor([5, 2]).numpy(), None, 2)\n"
            "maps = Path('/proc/self/maps').read_text().splitlines()\n"
            "print(sorted({l.split()[-1] for l in maps if 'libgomp' in l or 'libiomp' in l}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    runtimes = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes


def test_calls_leave_torch_and_openmp_thread_counts_as_found():
    before = torch.get_num_threads()
    gomp = next((ctypes.CDLL(path) for path in _mapped_openmp_runtimes() if "gomp" in path), None) \
        if sys.platform.startswith("linux") else None
    openmp_before = gomp.omp_get_max_threads() if gomp else None
    B = torch.randn(3, 6, 6, dtype=torch.float64)
    B = B @ B.mT
    extension.C.core_spectra(B.numpy(), B[:, None].contiguous().numpy(), torch.tensor([6, 4, 1]).numpy(), 4)
    extension.C.gram_spectra(B.numpy(), 4)
    assert torch.get_num_threads() == before
    if gomp:
        assert gomp.omp_get_max_threads() == openmp_before


def test_an_engine_pass_leaves_scipys_blas_threads_as_found():
    """The pass holds SciPy's BLAS at one thread while it forms host Grams, and gives the count back."""
    from conftest import padded_batch, random_sequences, tiny_model
    from threadpoolctl import ThreadpoolController

    from gradspec.engine.spectral_engine import SpectralEngine

    controller = ThreadpoolController()
    seen = []
    with controller.limit(limits=2, user_api="blas"):
        before = [info["num_threads"] for info in controller.info() if info["user_api"] == "blas"]
        engine = SpectralEngine(tiny_model("llama", vocab=300), "attn")
        real = extension.C.segment_gram

        def spy(*args):  # SciPy's BLAS, which the extension calls (another library's, faiss's, is not held)
            seen.extend(info["num_threads"] for info in ThreadpoolController().info()
                        if info["user_api"] == "blas" and "scipy" in info["filepath"])
            return real(*args)

        extension.C = _Spy(extension.C, segment_gram=spy)
        try:
            engine.score(*padded_batch(random_sequences([9, 5], 300)))
        finally:
            extension.C = extension.C.wrapped
        after = [info["num_threads"] for info in controller.info() if info["user_api"] == "blas"]
    assert seen and set(seen) == {1}
    assert after == before


class _Spy:
    """A module with some attributes replaced."""

    def __init__(self, wrapped, **replaced) -> None:
        self.wrapped, self.replaced = wrapped, replaced

    def __getattr__(self, name):
        return self.replaced.get(name) or getattr(self.wrapped, name)
