"""The slow, faithful baseline: one sample at a time, real parameter gradients, full SVD.

This is how the public reference code scores a sample; every fast path is tested against it. It
knows no layer kind: each part names the slice of a parameter it is (gradspec.layers.registry.Part),
and the model runs its own forward (its own experts implementation included).
"""

from __future__ import annotations

import torch
from torch import nn

from gradspec.engine.loss import response_loss_per_sample
from gradspec.layers.lora import unwrap
from gradspec.layers.targets import select_targets
from gradspec.linalg.metrics import metrics_dict, metrics_from_singular_values


def parameter_gradients(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                        modules: str | list[str] = "attn") -> tuple[float, dict[str, torch.Tensor]]:
    """One unpadded sample (1-D input_ids and labels) -> (loss, {part: its gradient (d_out, d_in), fp64}),
    by autograd of the response loss with respect to the parameters the parts are slices of."""
    base = unwrap(model)
    parts = [p for t in select_targets(model, modules) for p in t.parts]
    parameters = dict(base.named_parameters())
    wanted = [parameters[name] for name in dict.fromkeys(p.parameter for p in parts)]
    modes = [(m, m.training) for m in model.modules()]
    flags = [(p, p.requires_grad, p.grad) for p in model.parameters()]
    model.eval()
    model.requires_grad_(False)
    for w in wanted:
        w.requires_grad_(True)
        w.grad = None
    try:
        with torch.enable_grad():
            logits = model(input_ids=input_ids[None], use_cache=False).logits
            loss, count = response_loss_per_sample(logits, labels[None])
            if count.item() == 0:
                raise ValueError("the sample has no response tokens")
            loss.sum().backward()
        return loss.item(), {p.name: p.gradient(parameters).double().clone() for p in parts}
    finally:
        for m, training in modes:
            m.training = training
        for p, requires_grad, grad in flags:
            p.grad = grad
            p.requires_grad_(requires_grad)


def reference_scores(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, modules: str | list[str] = "attn"
) -> tuple[float, dict[str, dict[str, float]], dict[str, torch.Tensor]]:
    """One unpadded sample (1-D input_ids and labels) -> (loss, {part: {metric: value}}, {part: sigma})."""
    loss, gradients = parameter_gradients(model, input_ids, labels, modules)
    metrics, spectra = {}, {}
    for name, g in gradients.items():
        # the same values; LAPACK's SVD of a wide matrix is ~4x slower than of its transpose
        sigma = torch.linalg.svdvals(g.T if g.shape[0] < g.shape[1] else g)
        spectra[name] = sigma
        metrics[name] = metrics_dict(metrics_from_singular_values(sigma))
    return loss, metrics, spectra
