"""The slow, faithful baseline: one sample at a time, real parameter gradients, full SVD.

This is how the public reference code scores a sample; every fast path is tested against it.
"""

from __future__ import annotations

import torch
from torch import nn

from gradspec.engine.loss import response_loss_per_sample
from gradspec.layers.targets import select_targets
from gradspec.linalg.metrics import metrics_dict, metrics_from_singular_values


def reference_scores(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, modules: str | list[str] = "attn"
) -> tuple[float, dict[str, dict[str, float]], dict[str, torch.Tensor]]:
    """One unpadded sample (1-D input_ids and labels) -> (loss, {part: {metric: value}}, {part: sigma})."""
    model.eval()
    targets = select_targets(model, modules)
    model.requires_grad_(False)
    weights = [t.module.weight for t in targets]
    for w in weights:
        w.requires_grad_(True)
        w.grad = None
    try:
        logits = model(input_ids=input_ids[None], use_cache=False).logits
        loss, count = response_loss_per_sample(logits, labels[None])
        if count.item() == 0:
            raise ValueError("the sample has no response tokens")
        loss.sum().backward()
        metrics, spectra = {}, {}
        for t in targets:
            grad = t.module.weight.grad
            grad = grad.T if t.transposed else grad  # (d_out, d_in)
            for p in t.parts:
                g = grad[p.start : p.start + p.d_out].double()
                # the same values; LAPACK's SVD of a wide matrix is ~4x slower than of its transpose
                sigma = torch.linalg.svdvals(g.T if g.shape[0] < g.shape[1] else g)
                spectra[p.name] = sigma
                metrics[p.name] = metrics_dict(metrics_from_singular_values(sigma))
        return loss.item(), metrics, spectra
    finally:
        for w in weights:
            w.grad = None
            w.requires_grad_(False)
