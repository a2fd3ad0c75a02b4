"""The two extension points, used as a user's program would, from outside the package: a layer kind
and a metric, each one registration."""

import json

import pytest
import torch
from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model
from torch import nn

import gradspec
from gradspec.layers import registry
from gradspec.linalg import metrics


class Projection(nn.Module):
    """A user's own layer type: y = x K^T, its weight under another name."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.kernel = nn.Parameter(inner.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel.T


@pytest.fixture
def registries(monkeypatch):
    """Whatever a test registers is gone after it."""
    monkeypatch.setattr(registry, "LAYER_KINDS", list(registry.LAYER_KINDS))
    monkeypatch.setattr(metrics, "_METRICS", dict(metrics._METRICS))


def test_a_layer_kind_is_one_registration(registries):
    model = tiny_model("llama", vocab=500).double()
    for layer in model.model.layers:
        layer.self_attn.v_proj = Projection(layer.self_attn.v_proj)
    with pytest.raises(ValueError, match="no module matches"):
        gradspec.SpectralEngine(model, "v")

    @gradspec.register_layer_kind
    def projection(model, name, module):
        return gradspec.linear_target(model, name, module, weight="kernel") if isinstance(module, Projection) else None

    engine = gradspec.SpectralEngine(model, "v")
    assert engine.part_names == ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]
    seqs = random_sequences([6, 40], 500)
    assert_matches_reference(model, engine.score(*padded_batch(seqs)), seqs, "v")


def test_a_metric_is_one_registration(registries, tmp_path, tiny_model_dir):
    gradspec.register_metric("sum_sq", lambda sigma: metrics.ordered_sum(sigma * sigma))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "What is 2+2?", "output": "The answer is 4."}) + "\n")
    df = gradspec.score(data, str(tiny_model_dir), tmp_path / "s.parquet", max_length=64, progress=False)
    q = "model.layers.0.self_attn.q_proj"
    assert df.loc[0, f"{q}/sum_sq"] == pytest.approx(df.loc[0, f"{q}/frobenius_norm"] ** 2, rel=1e-12)
    assert gradspec.read_metadata(tmp_path / "s.parquet")["metrics"][-1] == "sum_sq"
    with pytest.raises(ValueError, match="without '/'"):
        gradspec.register_metric("a/b", lambda sigma: sigma.sum(-1))
    with pytest.raises(ValueError, match="nuclear_norm is a built-in metric"):  # its column flags zero gradients
        gradspec.register_metric("nuclear_norm", lambda sigma: sigma.sum(-1))
