"""Max relative error of gradspec on a bf16/fp16 model against the fp32 reference, on SmolLM2-135M.

    python benchmarks/precision.py [--samples 6] [--modules attn]

The model's weights are cast to the low precision; the fp32 reference uses the original weights,
so the error includes what the low-precision forward and backward change, as a user would see.
"""

from __future__ import annotations

import argparse
import copy

import torch

from gradspec.data import humaneval_samples
from gradspec.engine import SpectralEngine
from gradspec.metrics import METRICS
from gradspec.models import load_model
from gradspec.reference import reference_scores
from gradspec.scoring import pad_batch
from gradspec.templates import tokenize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--modules", default="attn")
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


if __name__ == "__main__":
    main()
