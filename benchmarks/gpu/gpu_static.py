"""Every Triton launch the dispatch can make, compiled ahead of time on the CPU for each GPU architecture of
kernels.blocks.BLOCKS (sm_80: A100; sm_90: H100, H200; sm_100: B200), with its static numbers: registers,
spills, shared memory, occupancy and, for the fp64 SYRK, how many fp64 MMA (DMMA) instructions its dot became.

    python -m benchmarks.gpu.gpu_static                             # the full table, into benchmarks/RESULTS.md
    python -m benchmarks.gpu.gpu_static --subset dispatch --json F  # what tests/kernels/test_compile_for_gpus.py checks

No GPU is needed: Triton compiles for a named target with its own bundled ptxas. The launches come from
gradspec.linalg.triton_launches (the dispatch's own tables); each is made by its launcher on meta tensors
(N, T, d, k) = SHAPE, with kernels.launch replaced by a recorder, so the compiled kernel is specialised as
the JIT would specialise that call (dtypes, constexpr flags, num_warps, 16-divisible sizes and strides).
Registers and spills are ptxas's own report (-v, which Triton runs with), shared memory Triton's metadata.

A launch fails its architecture (``problems``) on a compile error, on any register spill, on shared memory
above the architecture's per-block maximum, or, for the fp64 SYRK's dot, on PTX without fp64
``mma.sync.aligned.m8n8k4`` where the architecture has DMMA. Occupancy is reported, not judged: blocks
per SM = the fewest that registers (65,536 per SM, allocated per warp in units of 256), warps (64 per SM),
shared memory (per SM, 1 KiB reserved per block) and the 32-block cap allow; occupancy = those blocks'
warps / 64.

The full run also compiles the main launches at the candidate blocks 16 and 64 and applies kernels.blocks'
rule (the largest candidate at which every dtype and flag of the kernel's main path has no spill, fits the
shared memory, and reaches occupancy >= MIN_OCCUPANCY); a choice of BLOCKS the rule does not give is
reported (exit code 1). It also compiles the Triton Jacobi at the sizes gpu_suite's eigen table runs (not
a dispatch choice).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from gradspec.kernels import blocks as block_table

from gradspec.linalg.triton_launches import SHORT, TritonLaunch, triton_launches

HERE = Path(__file__).resolve().parent
SHAPE = (4, 1000, 4096, 72)  # (N, T, d, k): T of no particular divisibility; d, as every model width, of 16
CANDIDATES = (16, 32, 64)  # the block sizes the rule chooses among (the same for each block argument)
MIN_OCCUPANCY = 0.25  # four warps per scheduler
BEGIN, END = "<!-- gpu_static.py: begin -->", "<!-- gpu_static.py: end -->"
DMMA = re.compile(r"mma\.sync\.aligned\.m8n8k4\.row\.col\.f64\.f64\.f64\.f64")


@dataclass(frozen=True)
class Arch:
    """What a GPU architecture allows a block and an SM (NVIDIA's CUDA C++ Programming Guide, compute
    capabilities: shared memory is the opt-in maximum, 163 KiB on 8.0, 227 KiB on 9.0 and 10.0)."""

    name: str
    gpus: str
    smem_per_block: int
    smem_per_sm: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    fp64_mma: bool = True  # DMMA: fp64 mma.sync m8n8k4


ARCHS = {
    80: Arch("sm_80", "A100", 163 * 1024, 164 * 1024),
    90: Arch("sm_90", "H100, H200", 227 * 1024, 228 * 1024),
    100: Arch("sm_100", "B200", 227 * 1024, 228 * 1024),
}


def occupancy(regs: int, warps: int, shared: int, arch: Arch) -> float:
    """The share of the SM's warps resident at once (the module docstring says how)."""
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    blocks = min(arch.max_blocks_per_sm, arch.regs_per_sm // regs_per_warp // warps, arch.max_warps_per_sm // warps,
                 arch.smem_per_sm // (shared + 1024))
    return blocks * warps / arch.max_warps_per_sm


def problems(row: dict, arch: Arch) -> list[str]:
    """Why a compiled launch fails its architecture (empty: it does not)."""
    if row.get("error"):
        return [f"compile error: {row['error']}"]
    found = []
    if row["spill_stores"] or row["spill_loads"]:
        found.append(f"register spills: {row['spill_stores']} bytes stored, {row['spill_loads']} loaded "
                     f"({row['registers']} registers)")
    if row["shared"] > arch.smem_per_block:
        found.append(f"shared memory {row['shared']} bytes > {arch.smem_per_block} per block on {arch.name}")
    if row["kernel"] == "segment_syrk64" and row["dot"] and arch.fp64_mma and not row["fp64_mma"]:
        found.append(f"the fp64 dot is not DMMA on {arch.name} (no fp64 mma.sync.aligned.m8n8k4 in the PTX)")
    return found


def recorded(launch: TritonLaunch, arch: int | None, blocks: dict | None = None) -> tuple:
    """(jit function, args, meta) of the one kernel launch the launcher makes for launch on meta tensors."""
    calls = []
    module = sys.modules[launch.launcher.__module__]
    with mock.patch.object(module, "launch", lambda kernel, grid, *args, **meta: calls.append((kernel, args, meta))):
        if blocks is None:
            launch.run(*launch.inputs(*SHAPE, device="meta"), arch=arch)
        else:
            launch.launcher(*launch.inputs(*SHAPE, device="meta"), **blocks, **({} if launch.dot else {"dot": False}))
    (call,) = calls
    return call


def compile_for(kernel, args: tuple, meta: dict, arch: int) -> dict:
    """The launch kernel[grid](*args, **meta) compiled for arch: its static numbers, or its error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # The JIT's own specialisation of these arguments (as JITFunction.run does before compiling)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # ptxas -v's report, printed where dump_ptxas_log is set
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
    except Exception as error:  # noqa: BLE001 - a compile error is the finding, recorded with its text
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    report = log.getvalue()
    used = re.findall(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if len(used) != 1 or len(spills) != 1:
        raise RuntimeError(f"ptxas's report names {len(used)} register counts (want 1): is knobs.nvidia.dump_ptxas_log "
                           f"still honoured, and the cache bypassed (fresh_compiles)?\n{report[-2000:]}")
    return {"registers": int(used[0]), "spill_stores": int(spills[0][0]), "spill_loads": int(spills[0][1]),
            "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
            "fp64_mma": len(DMMA.findall(compiled.asm["ptx"])), "seconds": time.perf_counter() - start}


def static_row(launch: TritonLaunch, arch: int, blocks: dict | None = None) -> dict:
    """One launch compiled for arch at the table's blocks (or these), with its occupancy and problems."""
    kernel, args, meta = recorded(launch, arch, blocks)
    row = {"label": launch.label, "kernel": launch.kernel, "stage": launch.stage, "precision": launch.precision,
           "dtype": SHORT[launch.dtype], "other": launch.other, "dot": launch.dot, "fallback": launch.fallback,
           "arch": arch, "blocks": blocks or launch.blocks(arch), "table": blocks is None,
           "constexprs": {k: v for k, v in meta.items() if k.isupper()}}
    row |= compile_for(kernel, args, meta, arch)
    if "error" not in row:
        row["occupancy"] = occupancy(row["registers"], row["num_warps"], row["shared"], ARCHS[arch])
    row["problems"] = problems(row, ARCHS[arch])
    return row


def jacobi_sizes() -> list[int]:
    """The n at which gpu_suite's eigen table runs the Triton Jacobi (fp64 Grams, n <= JACOBI_MAX_N)."""
    from benchmarks.gpu import gpu_suite

    return [n for n in gpu_suite.EIGEN_SIZES if n <= gpu_suite.JACOBI_MAX_N]


def jacobi_row(n: int, arch: int) -> dict:
    """The Triton Jacobi for n x n fp64 matrices compiled for arch."""
    from gradspec.kernels import jacobi_eigvalsh

    calls = []
    with mock.patch.object(jacobi_eigvalsh, "launch", lambda kernel, grid, *a, **m: calls.append((kernel, a, m))):
        jacobi_eigvalsh.jacobi_eigvalsh_triton(torch.empty(3, n, n, dtype=torch.float64, device="meta"))
    (kernel, args, meta), = calls
    row = {"label": f"jacobi_eigvalsh/fp64/n{n}", "kernel": "jacobi_eigvalsh", "arch": arch, "dot": False,
           "fallback": False, "blocks": {"BLOCK": meta["BLOCK"]}} | compile_for(kernel, args, meta, arch)
    if "error" not in row:
        row["occupancy"] = occupancy(row["registers"], row["num_warps"], row["shared"], ARCHS[arch])
    row["problems"] = problems(row, ARCHS[arch])
    return row


def tasks(name: str, archs: list[int]) -> list[tuple]:
    """(function, args) of each compilation: "dispatch": every launch of the dispatch at its blocks, per
    architecture; "full": those, then the main launches at the other candidate blocks, then the Jacobi."""
    launches = triton_launches()
    todo = [(static_row, (launch, arch)) for launch in launches for arch in archs]
    if name == "full":
        for launch in [t for t in launches if not t.fallback]:
            for arch in archs:
                for b in CANDIDATES:
                    candidate = {argument: b for argument in launch.blocks(arch)}
                    if candidate != launch.blocks(arch):
                        todo.append((static_row, (launch, arch, candidate)))
        todo += [(jacobi_row, (n, arch)) for n in jacobi_sizes() for arch in archs]
    return todo


def fresh_compiles(cache: str) -> None:
    """Every compilation in this process afresh, in cache (so ptxas runs and reports), its report printed."""
    from triton import knobs

    knobs.cache.dir = cache
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True


def compile_all(todo: list[tuple], jobs: int) -> list[dict]:
    """Each task's row, in order, over jobs processes (forked where the platform can: no re-import)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        fresh_compiles(cache)
        if jobs <= 1:
            for fn, args in todo:
                rows.append(fn(*args))
                print(json.dumps(rows[-1]), flush=True)
            return rows
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=fresh_compiles, initargs=(cache,)) as pool:
            for future in [pool.submit(fn, *args) for fn, args in todo]:
                rows.append(future.result())
                print(json.dumps(rows[-1]), flush=True)
    return rows


def rule(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """kernels.blocks' rule per (kernel, arch) over the main launches' rows at each candidate block: the
    largest block that every dtype and flag compiles at without a problem and at MIN_OCCUPANCY or more."""
    verdicts: dict[tuple[str, int], dict] = {}
    for row in rows:
        if row["fallback"] or row["kernel"] == "jacobi_eigvalsh":
            continue
        block = next(iter(row["blocks"].values()))
        entry = verdicts.setdefault((row["kernel"], row["arch"]), {}).setdefault(block, [])
        entry.append(row)
    chosen = {}
    for key, by_block in verdicts.items():
        summary = {}
        for block, group in sorted(by_block.items()):
            ok = all(not r["problems"] and r["occupancy"] >= MIN_OCCUPANCY for r in group)
            summary[block] = {"ok": ok, "registers": max(r.get("registers", 0) for r in group),
                              "spills": max(r.get("spill_stores", 0) + r.get("spill_loads", 0) for r in group),
                              "shared": max(r.get("shared", 0) for r in group),
                              "occupancy": min(r.get("occupancy", 0.0) for r in group),
                              "errors": sum("error" in r for r in group)}
        good = [b for b, s in summary.items() if s["ok"]]
        table = next(iter(block_table.BLOCKS[key[1]][key[0]].values()))
        chosen[key] = {"blocks": summary, "rule": max(good) if good else None, "table": table}
    return chosen


def environment() -> dict:
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    versions, used_for = {}, {}
    for arch in ARCHS:  # Triton runs one ptxas below sm_90, another from sm_90 on
        path = get_ptxas(arch).path
        text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        versions[Path(path).name] = (re.findall(r"release [\d.]+, V[\d.]+", text) or ["?"])[0]
        used_for.setdefault(Path(path).name, []).append(ARCHS[arch].name)
    versions = {name: f"{version} ({', '.join(used_for[name])})" for name, version in versions.items()}
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = (re.findall(r"Model name:\s*(.+)", cpu) or [platform.processor()])[0].strip()
    return {"date": time.strftime("%Y-%m-%d"), "cpu": model, "cores": os.cpu_count(), "triton": triton.__version__,
            "torch": torch.__version__, "ptxas": versions, "shape": dict(zip("NTdk", SHAPE, strict=True))}


def _cell(row: dict) -> str:
    if "error" in row:
        return "**compile error**"
    spill = row["spill_stores"] + row["spill_loads"]
    text = (f"{row['registers']} regs, {'**' + str(spill) + ' B spilled**' if spill else 'no spill'}, "
            f"{row['shared'] / 1024:.0f} KiB, {row['occupancy']:.0%}")
    return text + (f", {row['fp64_mma']} DMMA" if row["kernel"] == "segment_syrk64" else "")


def markdown(result: dict) -> str:
    env, rows = result["environment"], result["rows"]
    archs = sorted({r["arch"] for r in rows})
    names = ", ".join(f"{ARCHS[a].name} ({ARCHS[a].gpus})" for a in archs)
    bad = [r for r in rows if r.get("table") and r["problems"]]
    lines = [BEGIN, f"## {env['date']} — `gpu_static.py`: every Triton launch the dispatch can make, compiled for "
             f"{', '.join(ARCHS[a].name for a in archs)} on the CPU (issue 51, item 3)", "",
             f"{env['cpu']}, {env['cores']} cores; Triton {env['triton']} with its bundled ptxas ("
             + "; ".join(f"{k}: {v}" for k, v in env["ptxas"].items()) + f"); torch {env['torch']}. No GPU: "
             f"`python -m benchmarks.gpu.gpu_static` ({result['seconds']:.0f} s) compiles each launch of "
             "`gradspec.linalg.triton_launches` for each architecture of `kernels.blocks.BLOCKS` "
             f"({names}) at (N, T, d, k) = {tuple(env['shape'].values())}, specialised as Triton's JIT "
             "specialises that call. Cells: registers a thread (ptxas -v), spills, shared memory a block "
             "(Triton's metadata), occupancy (resident warps / 64, from registers, warps, shared memory and "
             "the 32-block cap: the script's docstring) and, for the fp64 SYRK, its fp64 `mma.sync.aligned."
             "m8n8k4` (DMMA) instructions. `/other`: the fused ⟨Gram, other⟩; `/fma`: the SYRK's FMA loop, "
             "taken where the fp64 dot fails to compile. The GPU acceptance run's suite "
             "(`benchmarks/gpu/gpu_suite.py`, kernel table) times exactly these launches.", "",
             f"Verdict: {len(bad)} launch{'es' if len(bad) != 1 else ''} with a problem (compile error, "
             "spill, shared memory over the limit, fp64 dot not DMMA) at the blocks the dispatch uses"
             + (": " + "; ".join(f"{r['label']} on {ARCHS[r['arch']].name}: {r['problems']}" for r in bad)
                if bad else "."), "",
             "| launch (kernel/dtype) | precision | blocks | " + " | ".join(ARCHS[a].name for a in archs) + " |",
             "|---|---|---|" + "---|" * len(archs)]
    table = {(r["label"], r["arch"]): r for r in rows if r.get("table")}
    for label in dict.fromkeys(r["label"] for r in rows if r.get("table")):
        first = table[label, archs[0]]  # the blocks as compiled (the FMA loop's BLOCK_D is at most 8)
        blocks = ", ".join(f"{k} {v}" for k, v in first["constexprs"].items() if k.startswith("BLOCK"))
        lines.append(f"| {label} | {first['precision']} | {blocks} | "
                     + " | ".join(_cell(table[label, a]) for a in archs) + " |")
    if result.get("rule"):
        lines += ["", f"Block sizes (`kernels/blocks.py`'s rule: the largest of {', '.join(map(str, CANDIDATES))} "
                  "at which every dtype and flag of the kernel's main path has no spill, fits the shared memory "
                  f"and reaches occupancy ≥ {MIN_OCCUPANCY:.0%}); each cell: the most registers, spilled bytes "
                  "and shared memory, and the least occupancy over the dtypes and flags:", "",
                  "| kernel | architecture | " + " | ".join(f"block {b}" for b in CANDIDATES)
                  + " | rule | `BLOCKS` |", "|---|---|" + "---|" * (len(CANDIDATES) + 2)]
        for (kernel, arch), verdict in result["rule"].items():
            cells = []
            for b in CANDIDATES:
                s = verdict["blocks"].get(b)
                cells.append("" if s is None else ("compile error" if s["errors"] else
                             f"{s['registers']} regs, {s['spills']} B spilled, {s['shared'] / 1024:.0f} KiB, "
                             f"{s['occupancy']:.0%}" + ("" if s["ok"] else " ✗")))
            lines.append(f"| {kernel} | {ARCHS[arch].name} | " + " | ".join(cells)
                         + f" | {verdict['rule']} | {verdict['table']} |")
    jacobi = [r for r in rows if r["kernel"] == "jacobi_eigvalsh"]
    if jacobi:
        lines += ["", "Not a dispatch choice: the Triton Jacobi (`kernels/jacobi_eigvalsh.py`) at the fp64 sizes "
                  "gpu_suite's eigen table runs it:", "",
                  "| Jacobi | " + " | ".join(ARCHS[a].name for a in archs) + " |", "|---|" + "---|" * len(archs)]
        by = {(r["label"], r["arch"]): r for r in jacobi}
        for label in dict.fromkeys(r["label"] for r in jacobi):
            lines.append(f"| {label} (BLOCK {by[label, archs[0]]['blocks']['BLOCK']}) | "
                         + " | ".join(_cell(by[label, a]) for a in archs) + " |")
    return "\n".join(lines + [END]) + "\n"


def write_section(path: Path, section: str) -> None:
    """This script's section of RESULTS.md replaced (appended the first time); the others left as they are."""
    from gradspec.files import atomic_write

    text = path.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section.rstrip("\n") + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    atomic_write(path, lambda f: f.write(text.encode()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--subset", choices=("full", "dispatch"), default="full",
                   help="full: the dispatch's launches, the candidate blocks and the Jacobi, into RESULTS.md; "
                   "dispatch: the dispatch's launches alone (tests/kernels/test_compile_for_gpus.py)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    p.add_argument("--json", type=Path, help="write the rows here (JSON)")
    p.add_argument("--results", type=Path, default=HERE.parent / "RESULTS.md",
                   help="the RESULTS.md whose section the full subset writes")
    p.add_argument("--no-results", action="store_true", help="write no RESULTS.md section")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    start = time.perf_counter()
    archs = sorted(block_table.BLOCKS)
    missing = [a for a in archs if a not in ARCHS]
    if missing:
        p.error(f"kernels.blocks.BLOCKS names architectures {missing} this script has no limits for (ARCHS)")
    rows = compile_all(tasks(args.subset, archs), args.jobs)
    result = {"environment": environment(), "rows": rows, "seconds": time.perf_counter() - start,
              "rule": rule(rows) if args.subset == "full" else {}}
    if args.json:
        serialisable = result | {"rule": {f"{k}@{a}": v for (k, a), v in result["rule"].items()}}
        args.json.write_text(json.dumps(serialisable, indent=1))
    section = markdown(result)
    print(section)
    if args.subset == "full" and not args.no_results:
        write_section(args.results, section)
    disagree = [f"{k} on {ARCHS[a].name}: rule {v['rule']}, BLOCKS {v['table']}" for (k, a), v in result["rule"].items()
                if v["rule"] != v["table"]]
    failed = [r for r in rows if r.get("table") and r["problems"]]
    for line in disagree:
        print(f"gpu_static: kernels.blocks.BLOCKS disagrees with its rule: {line}", file=sys.stderr)
    return 1 if disagree or failed else 0


if __name__ == "__main__":
    sys.exit(main())
