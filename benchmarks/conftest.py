import pytest

# Medians of the benchmarks run so far in this process, for ratios between them.
MEDIANS: dict[str, float] = {}


@pytest.fixture
def record(benchmark):
    """Run fn under pytest-benchmark and keep its median under name."""

    def run(name, fn, rounds):
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
        MEDIANS[name] = benchmark.stats.stats.median

    return run
