"""GPU suite: gradspec vs a training step vs the reference, on random-init models with real shapes.

    python benchmarks/gpu_suite.py --out gpu_results      # on a GPU: < 8 minutes
    python benchmarks/gpu_suite.py --smoke --out /tmp/s   # tiny shapes on the CPU (run by the tests)

First, the eigen stage's paths on 120 Grams per size and the Triton kernels against their torch
paths. Then, for each model shape (SmolLM2-135M, Qwen2.5-1.5B, Llama-3-8B; random weights, no
downloads), sequence length T and module set, on one batch of about --batch-tokens tokens:
gradspec's engine (``score``, and ``submit`` back to back as ``gradspec score`` runs it), a
plain training step (forward + backward with weight gradients, LM head at response positions
only, as in the engine), and an estimate of ``gradspec.engine.reference`` per sample, with peak memory;
last, what the engine's measured dispatch chose. The reference estimate is one sample's forward
and backward with the first module's SVD, plus one timed fp64 SVD per other module (a 7B
model's SVDs take minutes per sample; each weight shape is timed once, when first needed), not
a measured run of the reference. Each model gets an equal share of --budget-s; a configuration
that fails is recorded, not fatal, and results.json and results.md in --out are rewritten after
every row, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import torch

from gradspec.engine.loss import IGNORE_INDEX, response_losses
from gradspec.engine.reference import reference_scores
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.targets import select_targets
from gradspec.linalg import eigen, extension, solvers, stages
from gradspec.linalg.metrics import EPS64

# Real shapes of the three models (from their published configs).
SHAPES = {
    "SmolLM2-135M": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)),
    "Qwen2.5-1.5B": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)),
    "Llama-3-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
}
# (samples, tokens, features) for the segment-Gram kernel against its torch path.
KERNEL_SHAPES = [(16, 256, 576), (16, 512, 1536), (8, 1024, 4096), (32, 256, 14336)]
SMOKE_KERNEL_SHAPES = [(2, 16, 32)]
# (samples, tokens, features, sketch width) for the low-rank sketch's D^T P against its torch path.
TDOT_SHAPES = [(16, 512, 1536, 72), (8, 1024, 4096, 72), (8, 1024, 14336, 72)]
SMOKE_TDOT_SHAPES = [(2, 16, 32, 16)]
EIGEN_SIZES = [32, 64, 128, 256, 512]  # n of 120 batched eigenproblems (torch < 2.12 loops for n > 32)
SMOKE_EIGEN_SIZES = [8]
JACOBI_MAX_N = 128  # the Triton Jacobi holds a whole matrix in one program
LENGTHS = [512, 256, 1024]  # T = 512 first: the training-step target is there
SMOKE_SHAPES = {"tiny": ("llama", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256))}


def build_model(kind: str, shape: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_cls(**shape, max_position_embeddings=4096)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    return model.eval()


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
def svd_seconds(d_out: int, d_in: int, device: str) -> float:
    """Seconds of one fp64 SVD of a d_out x d_in matrix, measured once per shape when first needed."""
    torch.linalg.svdvals(torch.randn(8, 8, dtype=torch.float64, device=device))  # solver set-up
    G = torch.randn(d_out, d_in, dtype=torch.float64, device=device)
    return timed(partial(torch.linalg.svdvals, G), device, 1, warm_up=False)[0]


def reference_seconds_per_sample(model, batch, modules: str) -> float:
    """One sample's forward/backward with the first module's SVD, plus one SVD per other module."""
    ids, _, labels = batch
    parts = [(p.name, p.d_out, p.d_in) for t in select_targets(model, modules) for p in t.parts]
    one, _ = timed(partial(reference_scores, model, ids[0], labels[0], parts[0][0]), str(ids.device), 1)
    return one + sum(svd_seconds(d_out, d_in, str(ids.device)) for _, d_out, d_in in parts[1:])


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
    p_s, _ = timed(partial(pipelined, engine, batch, k), args.device, 1, warm_up=False)  # warm: score ran
    t_s, t_mem = timed(partial(train_step, model, batch), args.device, args.reps)
    model.requires_grad_(False)
    r_s = reference_seconds_per_sample(model, batch, modules)
    tokens = n * T
    return {"gradspec_samples_s": n / g_s, "gradspec_tokens_s": tokens / g_s,
            "pipelined_tokens_s": k * tokens / p_s, "train_step_tokens_s": tokens / t_s,
            "reference_samples_s": 1 / r_s, "vs_train_step": t_s / g_s, "pipelined_vs_train_step": k * t_s / p_s,
            "vs_reference": (n / g_s) * r_s, "gradspec_peak_gib": g_mem, "train_step_peak_gib": t_mem}


def run(args: argparse.Namespace, write: Callable[[list[dict]], None]) -> list[dict]:
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    lengths = [16, 32] if args.smoke else LENGTHS
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    rows, start = [], time.perf_counter()
    for i, (name, (kind, shape)) in enumerate(shapes.items()):
        deadline = start + args.budget_s * (i + 1) / len(shapes)  # its share, plus what earlier models left
        model = build_model(kind, shape, args.device, dtype)
        for T in lengths:
            n = max(1, args.batch_tokens // T)
            batch = make_batch(n, T, shape["vocab_size"], args.device)
            for modules in ("attn", "all"):
                row = dict(model=name, T=T, batch=n, modules=modules, dtype=str(dtype).removeprefix("torch."))
                if time.perf_counter() > deadline:
                    row["skipped"] = "time budget"
                else:
                    try:
                        row.update(measure(model, T, modules, batch, args))
                    except Exception as e:  # noqa: BLE001 - one configuration's failure must not cost the run
                        row["skipped"] = f"{type(e).__name__}: {e}"[:300]
                        if args.device.startswith("cuda"):
                            torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(rows)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


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
    """The Triton segment Gram and segment A^T B vs the fp64 torch paths the engine has without
    them, per shape, with the largest error relative to the largest entry."""
    from gradspec.kernels import segment_gram_torch, segment_gram_triton, segment_tdot_torch, segment_tdot_triton

    def row(kernel: str, shape: dict, fast, slow) -> dict:
        out = {"kernel": kernel, **shape}
        try:
            triton_s, _ = timed(fast, args.device, args.reps)
            torch_s, _ = timed(slow, args.device, args.reps)
            want = slow()
            err = ((fast().double() - want).abs().max() / want.abs().max()).item()
            out.update(triton_ms=triton_s * 1e3, torch_ms=torch_s * 1e3, speedup=torch_s / triton_s, max_rel_err=err)
        except Exception as e:  # noqa: BLE001 - one kernel's failure must not cost the GPU run
            nan = float("nan")
            error = f"{type(e).__name__}: {e}"[:300]
            out.update(triton_ms=nan, torch_ms=nan, speedup=nan, max_rel_err=nan, error=error)
        print(json.dumps(out), flush=True)
        return out

    rows = []
    for N, T, d in SMOKE_KERNEL_SHAPES if args.smoke else KERNEL_SHAPES:
        Y = torch.randn(N, T, d, generator=torch.Generator().manual_seed(d)).to(args.device)
        lengths = torch.full((N,), T, device=args.device)
        rows.append(row("segment_gram", dict(N=N, T=T, d=d), lambda Y=Y, n=lengths: segment_gram_triton(Y, n)[0],
                        lambda Y=Y, n=lengths: segment_gram_torch(Y, n)[0]))
    for N, T, d, k in SMOKE_TDOT_SHAPES if args.smoke else TDOT_SHAPES:
        g = torch.Generator().manual_seed(d)
        D = torch.randn(N, T, d, generator=g).to(args.device)  # fp32, as the low-rank sketch passes it
        P = torch.randn(N, T, k, generator=g).to(args.device)
        lengths = torch.full((N,), T, device=args.device)
        rows.append(row(f"segment_tdot_k{k}", dict(N=N, T=T, d=d), partial(segment_tdot_triton, D, P, lengths),
                        partial(segment_tdot_torch, D, P, lengths)))
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


REFERENCE_NOTE = ("gradspec / reference is an estimate, not a measured run of the reference: one sample's "
                  "forward/backward with the first module's SVD, plus one timed fp64 SVD per other module "
                  "(each weight shape timed once)")


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [", ".join(f"{k}: {v}" for k, v in env.items()), "", REFERENCE_NOTE + ".", "",
             "| model | T | batch | modules | gradspec tok/s | pipelined tok/s | train-step tok/s "
             "| gradspec / train step | pipelined / train step | gradspec / reference (estimate) "
             "| peak GiB (gradspec, train) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result.get("rows", []):
        head = f"| {r['model']} | {r['T']} | {r['batch']} | {r['modules']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} |||||||")
            continue
        lines.append(f"{head} {r['gradspec_tokens_s']:.0f} | {r['pipelined_tokens_s']:.0f} "
                     f"| {r['train_step_tokens_s']:.0f} | {r['vs_train_step']:.2f}x "
                     f"| {r['pipelined_vs_train_step']:.2f}x "
                     f"| {r['vs_reference']:.0f}x | {r['gradspec_peak_gib']:.1f}, {r['train_step_peak_gib']:.1f} |")
    lines += ["", "| eigen stage: n | matrices | path | ms | max rel err | error |", "|---:|---:|---|---:|---:|---|"]
    lines += [f"| {e['n']} | {e['N']} | {e['path']} | {e['ms']:.2f} | {e['max_rel_err']:.1e} | {e.get('error', '')} |"
              for e in result.get("eigen", [])]
    lines += ["", "| kernel | N | T | d | Triton ms | torch ms | speed-up | max rel err | error |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {k['kernel']} | {k['N']} | {k['T']} | {k['d']} | {k['triton_ms']:.2f} | {k['torch_ms']:.2f} "
              f"| {k['speedup']:.1f}x | {k['max_rel_err']:.1e} | {k.get('error', '')} |"
              for k in result.get("kernels", [])]
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
    p.add_argument("--budget-s", type=float, default=360.0, help="skip the remaining configurations after this")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch_tokens, args.reps = 64, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"environment": environment(args.device), "reference": REFERENCE_NOTE}

    def write(**parts) -> None:
        result.update(parts)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "results.md").write_text(markdown(result))

    write(eigen=eigen_rows(args))
    write(kernels=kernel_rows(args))
    run(args, lambda rows: write(rows=rows, dispatch=dispatch_rows()))
    print(markdown(result))


if __name__ == "__main__":
    main()
