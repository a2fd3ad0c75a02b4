"""Error of gradspec's approximations on SmolLM2-135M's real gradients.

    python -m benchmarks.gpu.precision [--samples 6] [--modules attn] [--ranks 16,64]

1. bf16/fp16 models against the fp32 reference (max relative error per metric). The weights are
   cast to the low precision; the reference uses the original ones, so the error includes what
   the low-precision forward and backward change, as a user would see.
2. ``method="lowrank"`` at each rank against the exact method (mean and max relative error).
"""

from __future__ import annotations

import argparse
import copy

import torch

from gradspec.data.batching import pad_batch
from gradspec.data.models import load_model
from gradspec.data.readers import humaneval_samples
from gradspec.data.templates import tokenize
from gradspec.engine.reference import reference_scores
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg.metrics import METRICS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--modules", default="attn")
    p.add_argument("--ranks", default="16,64")
    args = p.parse_args()
    model, tok = load_model()
    items = [tokenize(s.messages, tok, "plain", 2048) for s in humaneval_samples(args.samples)]
    reference = [reference_scores(model, torch.tensor(t.input_ids), torch.tensor(t.labels), args.modules)[1]
                 for t in items]
    batch = pad_batch(items, tok.pad_token_id, "cpu")
    print("| dtype | " + " | ".join(METRICS) + " |\n|---|" + "---:|" * len(METRICS))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        scores = SpectralEngine(copy.deepcopy(model).to(dtype), args.modules).score(*batch)
        worst = dict.fromkeys(METRICS, 0.0)
        for i, ref in enumerate(reference):
            for name, values in ref.items():
                for j, metric in enumerate(METRICS):
                    got = scores.metrics[name][i, j].item()
                    worst[metric] = max(worst[metric], abs(got - values[metric]) / abs(values[metric]))
        print(f"| {str(dtype).removeprefix('torch.')} | " + " | ".join(f"{worst[m]:.1e}" for m in METRICS) + " |")

    exact = SpectralEngine(model, args.modules).score(*batch)
    shown = ("nuclear_norm", "effective_rank", "spectral_norm", "stable_rank")
    print("\n| rank | " + " | ".join(f"{m} mean / max" for m in shown) + " | topk_energy mean |")
    print("|---:|" + "---:|" * (len(shown) + 1))
    for rank in (int(r) for r in args.ranks.split(",")):
        approx = SpectralEngine(model, args.modules, method="lowrank", rank=rank).score(*batch)
        rel = {m: torch.cat([((approx.metrics[n][:, j] - exact.metrics[n][:, j]) / exact.metrics[n][:, j]).abs()
                             for n in exact.metrics]) for j, m in enumerate(METRICS)}
        energy = torch.cat([approx.metrics[n][:, -1] for n in exact.metrics]).mean()
        print(f"| {rank} | " + " | ".join(f"{rel[m].mean():.1%} / {rel[m].max():.1%}" for m in shown)
              + f" | {energy:.3f} |")


if __name__ == "__main__":
    main()
