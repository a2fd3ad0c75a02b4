"""GPU suite: gradspec vs a training step vs the reference, on random-init models with real shapes.

    python benchmarks/gpu_suite.py --out gpu_results      # on a GPU: < 8 minutes
    python benchmarks/gpu_suite.py --smoke --out /tmp/s   # tiny shapes on the CPU (run by the tests)

For each model shape (SmolLM2-135M, Qwen2.5-1.5B, Llama-3-8B; random weights, no downloads),
sequence length T and module set, it times on one batch (about --batch-tokens tokens):
gradspec's engine, a plain training step (forward + backward with weight gradients), and
``gradspec.reference`` per sample, and records peak memory. The reference's SVDs are timed
on the first layer's modules and scaled to all modules (a 7B model's 4096x4096 SVDs take
minutes per sample). Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

from gradspec.engine import IGNORE_INDEX, SpectralEngine, response_loss_per_sample
from gradspec.modules import select_targets
from gradspec.reference import reference_scores

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
JACOBI_SIZES = [32, 64, 128]  # n of the batched eigenproblems (torch.linalg.eigvalsh loops for n > 32)
SMOKE_JACOBI_SIZES = [8]
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


def timed(fn, device: str, reps: int) -> tuple[float, float]:
    """(median seconds, peak GiB allocated) over reps runs after one warm-up."""
    fn()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
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
    ids, mask, labels = batch
    model.requires_grad_(True)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    response_loss_per_sample(logits, labels)[0].sum().backward()
    model.zero_grad(set_to_none=True)


def reference_seconds_per_sample(model, batch, modules: str) -> float:
    """Forward/backward of one sample plus the first layer's SVDs, scaled to all modules."""
    ids, _, labels = batch
    n_parts = sum(len(t.parts) for t in select_targets(model, modules))
    first = ",".join(p.name for t in select_targets(model, modules) for p in t.parts if ".0." in p.name)
    start = time.perf_counter()
    reference_scores(model, ids[0], labels[0], first)
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    reference_scores(model, ids[0], labels[0], first.split(",")[0])  # forward/backward + one SVD
    one = time.perf_counter() - start
    n_first = len(first.split(","))
    per_svd = max(elapsed - one, 0.0) / max(n_first - 1, 1)
    return one + per_svd * (n_parts - 1)


def run(args: argparse.Namespace) -> list[dict]:
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    lengths = [16, 32] if args.smoke else [256, 512, 1024]
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    rows, start = [], time.perf_counter()
    for name, (kind, shape) in shapes.items():
        model = build_model(kind, shape, args.device, dtype)
        for T in lengths:
            n = max(1, args.batch_tokens // T)
            batch = make_batch(n, T, shape["vocab_size"], args.device)
            for modules in ("attn", "all"):
                row = dict(model=name, T=T, batch=n, modules=modules, dtype=str(dtype).removeprefix("torch."))
                if time.perf_counter() - start > args.budget_s:
                    rows.append({**row, "skipped": "time budget"})
                    continue
                engine = SpectralEngine(model, modules)
                g_s, g_mem = timed(partial(engine.score, *batch), args.device, args.reps)
                t_s, t_mem = timed(partial(train_step, model, batch), args.device, args.reps)
                model.requires_grad_(False)
                r_s = reference_seconds_per_sample(model, batch, modules)
                tokens = n * T
                rows.append({**row,
                             "gradspec_samples_s": n / g_s, "gradspec_tokens_s": tokens / g_s,
                             "train_step_tokens_s": tokens / t_s, "reference_samples_s": 1 / r_s,
                             "vs_train_step": t_s / g_s, "vs_reference": (n / g_s) * r_s,
                             "gradspec_peak_gib": g_mem, "train_step_peak_gib": t_mem})
                print(json.dumps(rows[-1]), flush=True)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def jacobi_rows(args: argparse.Namespace) -> list[dict]:
    """The Triton batched Jacobi vs torch.linalg.eigvalsh on 120 PSD Grams per n, fp64 and fp32
    (N = matrices, T = n, d = the dtype's bits); a failure is recorded, not fatal."""
    from gradspec.kernels import jacobi_eigvalsh_triton

    rows = []
    for n in SMOKE_JACOBI_SIZES if args.smoke else JACOBI_SIZES:
        for dtype in (torch.float64, torch.float32):
            N = 2 if args.smoke else 120
            Y = torch.randn(N, n, 2 * n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
            grams = (Y @ Y.transpose(1, 2)).to(args.device, dtype)
            row = {"kernel": f"jacobi_eigvalsh_{str(dtype)[-7:]}", "N": N, "T": n, "d": torch.finfo(dtype).bits}
            try:
                triton_s, _ = timed(partial(jacobi_eigvalsh_triton, grams), args.device, args.reps)
                torch_s, _ = timed(partial(torch.linalg.eigvalsh, grams), args.device, args.reps)
                want = torch.linalg.eigvalsh(grams.double())
                err = ((jacobi_eigvalsh_triton(grams).double() - want).abs().max() / want.abs().max()).item()
                row.update(triton_ms=triton_s * 1e3, torch_ms=torch_s * 1e3, speedup=torch_s / triton_s,
                           max_rel_err=err)
            except Exception as e:  # noqa: BLE001 - one kernel's failure must not cost the GPU run
                row.update(triton_ms=float("nan"), torch_ms=float("nan"), speedup=float("nan"),
                           max_rel_err=float("nan"), error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kernel_rows(args: argparse.Namespace) -> list[dict]:
    """The Triton segment Gram and segment A^T B vs the fp64 torch paths the engine has without
    them, per shape, with the largest error relative to the largest entry."""
    from gradspec.kernels import segment_gram_torch, segment_gram_triton, segment_tdot_torch, segment_tdot_triton

    def row(kernel: str, shape: dict, fast, slow) -> dict:
        triton_s, _ = timed(fast, args.device, args.reps)
        torch_s, _ = timed(slow, args.device, args.reps)
        want = slow()
        err = ((fast().double() - want).abs().max() / want.abs().max()).item()
        out = {"kernel": kernel, **shape, "triton_ms": triton_s * 1e3, "torch_ms": torch_s * 1e3,
               "speedup": torch_s / triton_s, "max_rel_err": err}
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
    from gradspec.spectral import DISPATCH

    return [{"stage": key[0], "shape": list(key[1:]), "chosen": DISPATCH.chosen[key],
             "ms": {name: s * 1e3 for name, s in seconds.items()}} for key, seconds in DISPATCH.seconds.items()]


def markdown(rows: list[dict], device: str) -> str:
    head = ("| model | T | batch | modules | gradspec tok/s | train-step tok/s | gradspec / train step "
            "| gradspec / reference | peak GiB (gradspec, train) |\n|---|---:|---:|---|---:|---:|---:|---:|---:|")
    lines = [f"Device: {device}", "", head]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['T']} | {r['batch']} | {r['modules']} | skipped: {r['skipped']} |||||")
            continue
        lines.append(f"| {r['model']} | {r['T']} | {r['batch']} | {r['modules']} | {r['gradspec_tokens_s']:.0f} "
                     f"| {r['train_step_tokens_s']:.0f} | {r['vs_train_step']:.2f}x | {r['vs_reference']:.0f}x "
                     f"| {r['gradspec_peak_gib']:.1f}, {r['train_step_peak_gib']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining configurations after this")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch_tokens, args.reps = 64, 1
    rows = run(args)
    dispatch = dispatch_rows()
    kernels = kernel_rows(args) + jacobi_rows(args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": device, "rows": rows, "kernels": kernels,
                                                      "dispatch": dispatch}, indent=1))
    table = markdown(rows, device) + ("\n| kernel | N | T (n) | d (bits) | Triton ms | torch ms | speed-up "
                                      "| max rel err | error |\n")
    table += "|---|---:|---:|---:|---:|---:|---:|---:|---|\n" + "".join(
        f"| {k['kernel']} | {k['N']} | {k['T']} | {k['d']} | {k['triton_ms']:.2f} | {k['torch_ms']:.2f} "
        f"| {k['speedup']:.1f}x | {k['max_rel_err']:.1e} | {k.get('error', '')} |\n" for k in kernels)
    table += "\n| measured dispatch: stage | shape key | chosen | ms per candidate |\n|---|---|---|---|\n" + "".join(
        f"| {d['stage']} | {d['shape']} | {d['chosen']} | "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in d["ms"].items()) + " |\n" for d in dispatch)
    (out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
