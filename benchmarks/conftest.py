import pytest

from benchmarks.common import MEDIANS


@pytest.fixture
def record(benchmark):
    """Run fn under pytest-benchmark and keep its median under name (in common.MEDIANS, for ratios)."""

    def run(name, fn, rounds):
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
        MEDIANS[name] = benchmark.stats.stats.median

    return run
