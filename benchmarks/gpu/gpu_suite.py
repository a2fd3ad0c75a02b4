"""GPU suite: gradspec vs a training step vs the reference, on random-init models with real shapes.

    python -m benchmarks.gpu.gpu_suite --out gpu_results      # on a GPU: < 8 minutes
    python -m benchmarks.gpu.gpu_suite --smoke --out /tmp/s   # tiny shapes on the CPU (run by the tests)

First, the per-operation rates of the machine for the cost model (benchmarks/gpu/cost_model.py, quick:
seconds). Then, for each model shape (SmolLM2-135M, Qwen2.5-1.5B, Llama-3-8B; random weights, no
downloads) at T = 512, and each module set (q/k/v/o, all), on one batch of about --batch-tokens
tokens: gradspec's engine (``score``, and ``submit`` back to back as ``gradspec score`` runs it), a
plain training step (forward + backward with weight gradients, LM head at response positions
only, as in the engine), and ``gradspec.engine.reference`` per sample, with peak memory, and the cost
model's predicted samples/s beside each measured one. Then the eigen stage's paths on 120 Grams per
size and every Triton launch the dispatch can make (each kernel, input dtype and flag, at the blocks
kernels.blocks gives this GPU: the launches benchmarks/gpu/gpu_static.py compiles) against its torch path;
then T = 1024 (never Llama-3-8B: a lent
GPU's 8 minutes) and T = 256, where --budget-s remains; last, what the engine's measured dispatch chose.

The reference column is measured (``reference_kind`` "measured (k samples)": k samples scored by
gradspec.engine.reference, one at a time, parameter gradients and fp64 SVDs) where its estimate says
that takes at most REFERENCE_MEASURE_S, else an estimate (``reference_kind`` "estimate"): one
sample's forward and backward with the first module's SVD, plus one timed fp64 SVD per other module
(a 7B model's SVDs take minutes per sample; each weight shape is timed once, when first needed).
--budget-s counts the rows' time only (the rates and tables apart); a row not started within it
is recorded as skipped. A configuration that fails is recorded, not fatal, and results.json and
results.md in --out are rewritten after every row, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import torch

from benchmarks.common import SHAPES, build_model
from benchmarks.gpu import cost_model
from gradspec.data.templates import IGNORE_INDEX
from gradspec.engine.loss import response_losses
from gradspec.engine.reference import reference_scores
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.targets import select_targets
from gradspec.linalg import eigen, extension, solvers, stages
from gradspec.linalg.metrics import EPS64

# (samples, tokens, features) for each segment-Gram launch against its torch path.
KERNEL_SHAPES = [(16, 256, 576), (16, 512, 1536), (8, 1024, 4096), (32, 256, 14336)]
SMOKE_KERNEL_SHAPES = [(2, 16, 32)]
# (samples, tokens, features, sketch width) for the low-rank sketch's D^T P against its torch path.
TDOT_SHAPES = [(16, 512, 1536, 72), (8, 1024, 4096, 72), (8, 1024, 14336, 72)]
SMOKE_TDOT_SHAPES = [(2, 16, 32, 16)]
KERNEL_SECTION_S = 90.0  # the kernel table's launches (their compilation included) not started by then are skipped
EIGEN_SIZES = [32, 64, 128, 256, 512]  # n of 120 batched eigenproblems (torch < 2.12 loops for n > 32)
SMOKE_EIGEN_SIZES = [8]
JACOBI_MAX_N = 128  # the Triton Jacobi holds a whole matrix in one program
LENGTHS = [512, 1024, 256]  # every model at T = 512 first (the targets are there), then longer, then shorter
SMOKE_LENGTHS = [16, 32]
MAX_T = {"Llama-3-8B": 512}  # never Llama-3-8B at T >= 1024: it does not fit a lent GPU's 8 minutes
REFERENCE_MEASURE_S = 10.0  # the reference is measured on REFERENCE_SAMPLES samples where its estimate is this or less
REFERENCE_SAMPLES = 2
SMOKE_SHAPES = {"tiny": ("llama", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256))}


def make_batch(n: int, T: int, vocab: int, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(3, vocab, (n, T), generator=g)
    labels = ids.clone()
    labels[:, : T // 2] = IGNORE_INDEX  # the second half is the response
    return ids.to(device), torch.ones_like(ids).to(device), labels.to(device)


SLOW_S = 10.0  # a configuration whose warm-up takes longer gets one timed run: the call's time is limited


def timed(fn, device: str, reps: int, warm_up: bool = True) -> tuple[float, float]:
    """(median seconds, peak GiB allocated) over reps runs (one when the warm-up is slow), after one warm-up."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if warm_up:
        start = time.perf_counter()
        fn()
        sync()
        reps = 1 if time.perf_counter() - start > SLOW_S else reps
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    return sorted(times)[len(times) // 2], peak


def train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    """Forward and backward with weight gradients, the LM head at response positions only (the
    engine's own loss, so neither side gains from skipping the prompt's logits)."""
    ids, mask, labels = batch
    model.requires_grad_(True)
    response_losses(model, ids, mask, labels)[0].sum().backward()
    model.zero_grad(set_to_none=True)


@cache
def set_up_svd(device: str) -> None:
    """The fp64 SVD solver's one-time set-up on device (handles, workspace), kept out of timings."""
    torch.linalg.svdvals(torch.randn(8, 8, dtype=torch.float64, device=device))


@cache
def svd_seconds(d_out: int, d_in: int, device: str) -> float:
    """Seconds of one fp64 SVD of a d_out x d_in matrix, measured once per shape when first needed."""
    set_up_svd(device)
    G = torch.randn(d_out, d_in, dtype=torch.float64, device=device)
    return timed(partial(torch.linalg.svdvals, G), device, 1, warm_up=False)[0]


def reference_seconds_per_sample(model, batch, modules: str) -> float:
    """An estimate: one sample's forward/backward with the first module's SVD, plus one SVD per other
    module (of the tall orientation, as gradspec.engine.reference takes it)."""
    ids, _, labels = batch
    parts = [(p.name, p.d_out, p.d_in) for t in select_targets(model, modules) for p in t.parts]
    # No warm-up run: the model's kernels are warm (gradspec and the training step ran it), the SVD
    # solver is set up here, and a second reference with a 4096 x 4096 fp64 SVD costs a lent GPU seconds.
    set_up_svd(str(ids.device))
    one, _ = timed(partial(reference_scores, model, ids[0], labels[0], parts[0][0]), str(ids.device), 1,
                   warm_up=False)
    return one + sum(svd_seconds(max(d_out, d_in), min(d_out, d_in), str(ids.device)) for _, d_out, d_in in parts[1:])


def reference_columns(model, batch, modules: str) -> dict:
    """Samples/s of the reference: measured on REFERENCE_SAMPLES samples where the estimate says that
    takes at most REFERENCE_MEASURE_S, else the estimate; reference_kind says which."""
    ids, _, labels = batch
    estimate = reference_seconds_per_sample(model, batch, modules)
    out = {"reference_estimate_samples_s": 1 / estimate}
    k = min(REFERENCE_SAMPLES, len(ids))
    if estimate * k > REFERENCE_MEASURE_S:
        return out | {"reference_samples_s": 1 / estimate, "reference_kind": "estimate"}

    def score_k() -> None:
        for i in range(k):
            reference_scores(model, ids[i], labels[i], modules)

    measured, _ = timed(score_k, str(ids.device), 1, warm_up=False)  # warm: the estimate ran it
    return out | {"reference_samples_s": k / measured, "reference_kind": f"measured ({k} samples)"}


def predicted_columns(shape: dict, modules: str, T: int, n: int, rates, dtype: torch.dtype) -> dict:
    """The cost model's prediction for this row (benchmarks/gpu/cost_model.py): samples/s of score
    (serial), of submit back to back (overlapped) and of a training step, and seconds per stage."""
    if rates is None:
        return {}
    p = cost_model.predict_best(shape, modules, T, T - T // 2, rates, n, dtype.itemsize)
    return {"predicted_samples_s": p.serial_samples_s, "predicted_pipelined_samples_s": p.overlapped_samples_s,
            "predicted_train_step_samples_s": 1 / p.train_step_s, "predicted_placement": p.placement,
            "predicted_stages_s": p.stage_seconds()}


def pipelined(engine: SpectralEngine, batch, k: int) -> None:
    """k batches through submit, as gradspec score feeds them: each one's eigen stage beside the
    next one's forward and backward."""
    for future in [engine.submit(*batch) for _ in range(k)]:
        future.result()


def measure(model, T: int, modules: str, batch, args) -> dict:
    n = len(batch[0])
    engine = SpectralEngine(model, modules)
    g_s, g_mem = timed(partial(engine.score, *batch), args.device, args.reps)
    k = 3 if g_s < SLOW_S / 3 else 2
    # k batches in flight pin more batches of host copies than score did (gigabytes at 8B shapes): warmed
    # up where that costs little, so the timing is of the pipeline, not of pinning; the row says which.
    warm = g_s < SLOW_S / 4
    if warm:
        pipelined(engine, batch, k)
    p_s, _ = timed(partial(pipelined, engine, batch, k), args.device, 1, warm_up=False)
    t_s, t_mem = timed(partial(train_step, model, batch), args.device, args.reps)
    model.requires_grad_(False)
    tokens = n * T
    return {"gradspec_samples_s": n / g_s, "gradspec_tokens_s": tokens / g_s,
            "pipelined_samples_s": k * n / p_s, "pipelined_tokens_s": k * tokens / p_s,
            "train_step_samples_s": n / t_s, "train_step_tokens_s": tokens / t_s,
            "vs_train_step": t_s / g_s, "pipelined_vs_train_step": k * t_s / p_s, "pipelined_warmed_up": warm,
            "gradspec_peak_gib": g_mem,
            "train_step_peak_gib": t_mem}


def reference_of_row(model, batch, modules: str, gradspec_samples_s: float) -> dict:
    """The row's reference columns and gradspec's speed-up over it."""
    reference = reference_columns(model, batch, modules)
    return reference | {"vs_reference": gradspec_samples_s / reference["reference_samples_s"]}


def _reference_cell(row: dict) -> str:
    """gradspec / reference, and how the reference was had (or why not: not reached, failed)."""
    if "vs_reference" in row:
        return f"{row['vs_reference']:.3g}x ({row['reference_kind']})"
    return row.get("reference_kind", "not measured")


def plan(shapes: dict, lengths: list[int]) -> list[tuple[str, int]]:
    """(model, T) in the order measured: every model at the first length, the largest first (the
    issue's targets are Llama-3-8B's, and a lent GPU's budget may not reach the last rows), then
    every model at the next length, and so on; none above its MAX_T."""
    largest_first = sorted(shapes, key=lambda name: -shapes[name][1]["hidden_size"])
    return [(name, T) for T in lengths for name in largest_first if T <= MAX_T.get(name, T)]


class RowBudget:
    """--budget-s, spent by the rows alone: a row not started within it is skipped."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def spend(self, since: float) -> None:
        self.left -= time.perf_counter() - since


def run(args: argparse.Namespace, write: Callable[[list[dict]], None], pairs: list[tuple[str, int]],
        rows: list[dict], budget: RowBudget, rates=None) -> list[dict]:
    """The throughput rows of these (model, T), appended to rows (written after each one); a model
    is built when the pairs move on to it and dropped at the end."""
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    built, model = None, None
    for name, T in pairs:
        kind, shape = shapes[name]
        n = max(1, args.batch_tokens // T)
        for modules in ("attn", "all"):
            started = time.perf_counter()
            row = dict(model=name, T=T, batch=n, modules=modules, dtype=str(dtype).removeprefix("torch."))
            if budget.left <= 0:
                row["skipped"] = "time budget"
            else:
                try:
                    if built != name:
                        model = built = None
                        if args.device.startswith("cuda"):
                            torch.cuda.empty_cache()
                        model, built = build_model(kind, shape, args.device, dtype), name
                    batch = make_batch(n, T, shape["vocab_size"], args.device)
                    row.update(measure(model, T, modules, batch, args))
                except Exception as e:  # noqa: BLE001 - one configuration's failure must not cost the run
                    row["skipped"] = f"{type(e).__name__}: {e}"[:300]
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
            row.update(predicted_columns(shape, modules, T, n, rates, dtype))
            if "predicted_samples_s" in row and "gradspec_samples_s" in row:
                row["measured_vs_predicted"] = row["gradspec_samples_s"] / row["predicted_samples_s"]
            rows.append(row)
            write(rows)  # before the reference: a run cut off during its SVDs keeps the row's measurements
            if "gradspec_samples_s" in row:
                try:
                    row.update(reference_of_row(model, batch, modules, row["gradspec_samples_s"]))
                except Exception as e:  # noqa: BLE001 - the row stands without its reference column
                    row["reference_kind"] = f"failed: {type(e).__name__}: {e}"[:300]
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
                write(rows)
            if row.get("skipped") != "time budget":
                budget.spend(started)
            print(json.dumps(row), flush=True)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def measure_rates(args: argparse.Namespace) -> tuple[object, dict]:
    """The cost model's per-operation rates on this machine (quick), or None and the error."""
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    try:
        rates = cost_model.measure_rates(args.device, extension.default_threads(), quick=True, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - the model's failure must not cost the GPU run
        return None, {"label": cost_model.PREDICTION, "error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps({"cost_model_rates_s": rates.seconds}), flush=True)
    return rates, {"label": cost_model.PREDICTION, "rates": rates.as_dict(), "lines": cost_model.rates_lines(rates)}


def eigen_rows(args: argparse.Namespace) -> list[dict]:
    """The gram eigen stage (eigenvalues to singular values, on the host) on 120 PSD
    fp64 Grams per n, by each path the engine can measure (C++ on the host, the copy included;
    torch and CuPy on the device) and the Triton Jacobi; error against the first path's."""
    from gradspec.kernels import jacobi_eigvalsh_triton

    paths = {"cpp": partial(eigen._gram_cpp, eps=EPS64, terms=0)} if extension.BUILT else {}
    paths["torch"] = partial(eigen._gram_device, solvers.TORCH_EIGEN)
    if solvers.cupy_eigen() is not None:
        paths["cupy"] = partial(eigen._gram_device, solvers.cupy_eigen())
    jacobi = solvers.Eigensolver(torch.linalg.eigh, jacobi_eigvalsh_triton)  # the gram stage uses eigvalsh only
    rows = []
    for n in SMOKE_EIGEN_SIZES if args.smoke else EIGEN_SIZES:
        N = 2 if args.smoke else 120
        Y = torch.randn(N, n, 2 * n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        grams = (Y @ Y.transpose(1, 2)).to(args.device)
        here = paths | ({"triton_jacobi": partial(eigen._gram_device, jacobi)} if n <= JACOBI_MAX_N else {})
        want = None
        for path, fn in here.items():
            row = {"n": n, "N": N, "path": path}
            try:
                seconds, _ = timed(partial(fn, grams), args.device, args.reps)
                sigma = fn(grams)
                want = sigma if want is None else want
                row.update(ms=seconds * 1e3, max_rel_err=((sigma - want).abs().max() / want.abs().max()).item())
            except Exception as e:  # noqa: BLE001 - one path's failure must not cost the GPU run
                row.update(ms=float("nan"), max_rel_err=float("nan"), error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def kernel_rows(args: argparse.Namespace) -> list[dict]:
    """Every Triton launch the dispatch can make (gradspec.linalg.triton_launches: each kernel, input dtype
    and flag, at the blocks kernels.blocks gives this device; benchmarks/gpu/gpu_static.py compiles the same
    launches for each architecture) against the stage's torch path at the same precision, per shape, with
    the largest error relative to the largest entry. The model's dtype first, the FMA fallbacks last;
    launches not started within KERNEL_SECTION_S are recorded as skipped."""
    from gradspec.kernels.blocks import blocks

    from gradspec.linalg.triton_launches import triton_launches

    def relative_error(got, want) -> float:
        got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)  # a Gram's inner product aside
        return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()

    rows, start = [], time.perf_counter()
    model_dtype = getattr(torch, args.dtype)
    launches = sorted(triton_launches(), key=lambda t: (t.fallback, t.dtype != model_dtype))
    for launch in launches:
        gram = launch.stage == "segment_gram"
        for shape in (SMOKE_KERNEL_SHAPES if gram else SMOKE_TDOT_SHAPES) if args.smoke else (
                KERNEL_SHAPES if gram else TDOT_SHAPES):
            N, T, d, k = (*shape, 0) if gram else shape
            out = {"kernel": launch.label, "stage": launch.stage, "precision": launch.precision, "N": N, "T": T, "d": d,
                   **({} if gram else {"k": k}), "blocks": blocks(launch.kernel, torch.device(args.device))}
            if time.perf_counter() - start > KERNEL_SECTION_S:
                rows.append(out | {"skipped": "time budget"})
                continue
            try:
                generator = torch.Generator(args.device).manual_seed(d)
                inputs = launch.inputs(N, T, d, k, args.device, generator)
                fast, slow = partial(launch.run, *inputs), partial(launch.reference, *inputs)
                fast()  # compiled outside the timing
                triton_s, _ = timed(fast, args.device, args.reps)
                torch_s, _ = timed(slow, args.device, args.reps)
                out.update(triton_ms=triton_s * 1e3, torch_ms=torch_s * 1e3, speedup=torch_s / triton_s,
                           max_rel_err=relative_error(fast(), slow()))
            except Exception as e:  # noqa: BLE001 - one kernel's failure must not cost the GPU run
                nan = float("nan")
                error = f"{type(e).__name__}: {e}"[:300]
                out.update(triton_ms=nan, torch_ms=nan, speedup=nan, max_rel_err=nan, error=error)
            print(json.dumps(out), flush=True)
            rows.append(out)
    return rows


def dispatch_rows() -> list[dict]:
    """What gradspec's measured dispatch chose on this device during the runs, per stage and size."""
    dispatch = stages.DISPATCH
    return [{"stage": key[0], "shape": list(key[1:]), "chosen": dispatch.chosen[key],
             "ms": {name: s * 1e3 for name, s in seconds.items()}} for key, seconds in dispatch.seconds.items()]


def environment(device: str) -> dict:
    import triton

    try:
        import cupy
    except ImportError:
        cupy = None
    return {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "cupy": cupy and cupy.__version__,
            "host_threads": extension.default_threads(), "extension": extension.BUILT,
            "date": time.strftime("%Y-%m-%d")}


REFERENCE_NOTE = ("gradspec / reference: the reference is gradspec.engine.reference (one sample at a time, "
                  "parameter gradients, full fp64 SVD values; the paper's procedure takes fp32 SVDs). Each cell "
                  "says whether it was measured (on a few samples) or is an estimate: one sample's forward/"
                  "backward with the first module's SVD, plus one timed fp64 SVD per other module (each weight "
                  "shape timed once), not a measured run")


def _cell(row: dict, key: str, form: str = ".3g", suffix: str = "") -> str:
    value = row.get(key)
    return "" if value is None else f"{value:{form}}{suffix}"


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [", ".join(f"{k}: {v}" for k, v in env.items()), "", REFERENCE_NOTE + ".", "",
             "Columns marked predicted (cost model) are predictions of benchmarks/gpu/cost_model.py from rates "
             "measured on this machine at the start of the run, not measurements: score against the serial "
             "total, submit back to back against the overlapped one.", "",
             "| model | T | batch | modules | gradspec samples/s | predicted (cost model) | pipelined samples/s "
             "| predicted (cost model), overlapped | train-step samples/s | predicted (cost model), train step "
             "| gradspec tok/s | pipelined tok/s | train-step tok/s | gradspec / train step | pipelined / train step "
             "| gradspec / reference | peak GiB (gradspec, train) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in result.get("rows", []):
        head = f"| {r['model']} | {r['T']} | {r['batch']} | {r['modules']} |"
        predicted = [_cell(r, "predicted_samples_s"), _cell(r, "predicted_pipelined_samples_s"),
                     _cell(r, "predicted_train_step_samples_s")]
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} | {predicted[0]} | | {predicted[1]} | | {predicted[2]} "
                         "| | | | | | | |")
            continue
        cold = "" if r.get("pipelined_warmed_up", True) else " (cold: no warm-up)"
        lines.append(f"{head} {_cell(r, 'gradspec_samples_s')} | {predicted[0]} "
                     f"| {_cell(r, 'pipelined_samples_s')}{cold} "
                     f"| {predicted[1]} | {_cell(r, 'train_step_samples_s')} | {predicted[2]} "
                     f"| {r['gradspec_tokens_s']:.0f} | {r['pipelined_tokens_s']:.0f} "
                     f"| {r['train_step_tokens_s']:.0f} | {r['vs_train_step']:.2f}x "
                     f"| {r['pipelined_vs_train_step']:.2f}x "
                     f"| {_reference_cell(r)} "
                     f"| {r['gradspec_peak_gib']:.1f}, {r['train_step_peak_gib']:.1f} |")
    model = result.get("cost_model") or {}
    if model:
        lines += ["", "Cost model (predictions): " + model.get("error", "rates measured on this machine:"), ""]
        lines += model.get("lines", [])
        lines += ["", "| model | T | modules | eigen stage placed | predicted s/sample per stage | predicted /s "
                  "(serial) | measured /s (score) | measured / predicted |", "|---|---:|---|---|---|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['T']} | {r['modules']} | {r['predicted_placement']} | "
                  + ", ".join(f"{stage} {s * 1e3:.3g} ms" for stage, s in r["predicted_stages_s"].items())
                  + f" | {_cell(r, 'predicted_samples_s')} | {_cell(r, 'gradspec_samples_s')} "
                  f"| {_cell(r, 'measured_vs_predicted', '.2f', 'x')} |"
                  for r in result.get("rows", []) if "predicted_stages_s" in r]
    lines += ["", "| eigen stage: n | matrices | path | ms | max rel err | error |", "|---:|---:|---|---:|---:|---|"]
    lines += [f"| {e['n']} | {e['N']} | {e['path']} | {e['ms']:.2f} | {e['max_rel_err']:.1e} | {e.get('error', '')} |"
              for e in result.get("eigen", [])]
    lines += ["", "| kernel launch | precision | N | T | d | k | blocks | Triton ms | torch ms | speed-up "
              "| max rel err | error |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for k in result.get("kernels", []):
        head = (f"| {k['kernel']} | {k['precision']} | {k['N']} | {k['T']} | {k['d']} | {k.get('k', '')} "
                f"| {', '.join(f'{n} {v}' for n, v in k['blocks'].items())} |")
        lines.append(f"{head} | | | | | skipped: {k['skipped']} |" if "skipped" in k else
                     f"{head} {k['triton_ms']:.2f} | {k['torch_ms']:.2f} | {k['speedup']:.1f}x "
                     f"| {k['max_rel_err']:.1e} | {k.get('error', '')} |")
    lines += ["", "| measured dispatch: stage | shape key | chosen | ms per candidate |", "|---|---|---|---|"]
    lines += [f"| {d['stage']} | {d['shape']} | {d['chosen']} | "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in d["ms"].items()) + " |"
              for d in result.get("dispatch", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="seconds for the throughput rows (the rates and tables apart): a row not started "
                   "within it is skipped")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch_tokens, args.reps = 64, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"environment": environment(args.device), "reference": REFERENCE_NOTE}

    def write(**parts) -> None:
        """Both files replaced whole: a run cut off while writing keeps the previous ones."""
        result.update(parts)
        for name, text in (("results.json", json.dumps(result, indent=1)), ("results.md", markdown(result))):
            (out / f"{name}.part").write_text(text)
            os.replace(out / f"{name}.part", out / name)

    rates, model = measure_rates(args)
    write(cost_model=model)
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    pairs = plan(SMOKE_SHAPES if args.smoke else SHAPES, lengths)
    rows: list[dict] = []
    budget = RowBudget(args.budget_s)
    rows_written = lambda rows: write(rows=rows, dispatch=dispatch_rows())  # noqa: E731
    run(args, rows_written, [p for p in pairs if p[1] == lengths[0]], rows, budget, rates)
    write(eigen=eigen_rows(args))
    write(kernels=kernel_rows(args))
    run(args, rows_written, [p for p in pairs if p[1] != lengths[0]], rows, budget, rates)
    print(markdown(result))


if __name__ == "__main__":
    main()
