"""`gradspec score` beside a CPU hog on the same cores, against its quiet time (issue 41: a shared machine
slowed a run up to a hundredfold).

The command as a user runs it (a fresh process: imports, the default model, SmolLM2-135M-Instruct,
the first ROWS HumanEval rows at --max-length 256, q/k/v/o, Parquet out), under two thread policies:

- now: the command's own (gradspec.cli.POLITE_THREADS: OpenMP threads sleep when idle, NumPy's and
  SciPy's OpenBLAS on one thread);
- before: the same command from a process that has loaded torch and NumPy before it starts, so that the
  command sets nothing (each library's own default, as before: libgomp spins a while at every barrier,
  each OpenBLAS pool has a thread per core).

Each runs quiet and beside the hog: one busy process per core (os.cpu_count()), for the whole
command. On a fair share of the cores the command takes about twice its quiet time there. Rounds
interleave the four rows; the medians, each policy's hog/quiet ratio, and the command's CPU time
(children's rusage) are printed. Run with ``pytest benchmarks/throughput/bench_contention.py -s``;
BENCH_ROUNDS (default 3), BENCH_ROWS (default 32).
"""

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import interleaved_rounds

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
ROWS = int(os.environ.get("BENCH_ROWS", 32))
GRADSPEC = str(Path(sys.executable).parent / "gradspec")
POLICIES = {"now": [GRADSPEC],
            "before": [sys.executable, "-c", "import sys, numpy, torch; from gradspec.cli import main; "
                                             "sys.exit(main(sys.argv[1:]))"]}
HOG = "while True: pass"


def command(out: Path, launcher: list[str], cpu: list[float]) -> None:
    """One `gradspec score` run, its CPU time (user + system, of the child) appended to cpu."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([*launcher, "score", "--limit", str(ROWS), "--max-length", "256", "--out", str(out),
                    "--overwrite", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def beside_hog(run) -> None:
    """run() with one busy process per core for all of its time."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # the hogs are running before the command starts
        run()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_score_beside_a_cpu_hog(tmp_path):
    assert not {"OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS"} & set(os.environ), "run it without these set"
    cpu: dict[str, list[float]] = {}
    rows = {}
    for policy, launcher in POLICIES.items():
        for load in ("quiet", "hog"):
            name = f"{policy}, {load}"
            cpu[name] = []

            def run(launcher=launcher, name=name):
                command(tmp_path / "scores.parquet", launcher, cpu[name])

            rows[name] = run if load == "quiet" else (lambda run=run: beside_hog(run))
    command(tmp_path / "scores.parquet", POLICIES["now"], [])  # untimed: the default model cached, files warm
    times = interleaved_rounds(rows, ROUNDS, "contention: ")
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "unknown CPU")
    print(f"\n{cpu_model}, {os.cpu_count()} cores, {ROWS} rows, medians of {ROUNDS} rounds:")
    for name, t in times.items():
        print(f"  {name}: wall {statistics.median(t):.1f} s, CPU {statistics.median(cpu[name]):.1f} s")
    for policy in POLICIES:
        quiet, hog = (statistics.median(times[f"{policy}, {load}"]) for load in ("quiet", "hog"))
        print(f"  {policy}: beside the hog {hog / quiet:.2f}x its quiet time (rounds: "
              + ", ".join(f"{h / q:.2f}x" for h, q in zip(times[f"{policy}, hog"], times[f"{policy}, quiet"],
                                                         strict=True)) + ")")
