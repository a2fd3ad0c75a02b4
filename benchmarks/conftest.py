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


def interleaved_rounds(rows: dict, rounds: int, label: str = "") -> dict[str, list[float]]:
    """Seconds per round of each row (a callable); each round runs every row once, starting at
    another row, so rows compared share the machine's load of the moment."""
    import time

    times: dict[str, list[float]] = {row: [] for row in rows}
    names = list(rows)
    for r in range(rounds):
        for row in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            rows[row]()
            times[row].append(time.perf_counter() - start)
        print(f"\n{label}round {r + 1}/{rounds}: " + ", ".join(f"{row} {t[r]:.2f} s" for row, t in times.items()))
    return times
