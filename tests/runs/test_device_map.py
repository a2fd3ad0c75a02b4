"""--device-map: one process, the model dispatched by accelerate. The CPU has one device, so what
runs here is accelerate's dispatch itself: its hooks on every module, and weights offloaded to disk
(on the meta device between calls), which the engine must not need to read. Several GPUs are left
to benchmarks/gpu/gpu_acceptance.py (its device-map check splits a model between a GPU and the host)."""

import json

import pandas as pd
import pytest
import torch
from conftest import padded_batch, random_sequences, tiny_model

import gradspec
from gradspec.cli import main
from gradspec.data.models import input_device
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.runs.score_files import read_metadata

ROWS = [{"instruction": "Write a haiku about rain.", "output": "Soft rain on the roof,\nquiet streets."},
        {"instruction": "What is 2+2?", "output": "4"},
        {"instruction": "Name a colour.", "output": "Teal, the colour of shallow sea over sand."}]


def _offloaded(kind: str, tmp_path):
    """The same random model, dispatched with almost no memory: its weights offloaded to disk."""
    from transformers import AutoModelForCausalLM

    tiny_model(kind).save_pretrained(tmp_path / kind)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / kind, device_map="auto", max_memory={"cpu": "1MB"},
                                                 offload_folder=str(tmp_path / "offload"))
    assert {p.device.type for p in model.parameters()} == {"meta"}  # nothing resident between calls
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_an_offloaded_dispatched_model_scores_as_the_model_itself(kind, tmp_path):
    """Spectra, alignment and projection of every layer kind (experts and routers too), with accelerate's
    hooks on every module and the weights on disk, equal those of the undispatched model."""
    batch = padded_batch(random_sequences([14, 9, 5], 49152))
    task = [padded_batch(random_sequences([11, 7], 49152, seed=1))]
    got, want = [], []
    for model, results in ((_offloaded(kind, tmp_path), got), (tiny_model(kind), want)):
        assert input_device(model) == torch.device("cpu")
        with SpectralEngine(model, "all", project=4) as engine:
            engine.set_task(task)
            results.append(engine.score(*batch))
    (got,), (want,) = got, want
    assert [got.status(i) for i in range(3)] == ["ok"] * 3
    assert torch.equal(got.loss, want.loss)
    assert set(got.metrics) == set(want.metrics)
    for name in want.metrics:
        torch.testing.assert_close(got.metrics[name], want.metrics[name], rtol=1e-9, atol=0, equal_nan=True)
    for name in want.alignment:
        torch.testing.assert_close(got.alignment[name], want.alignment[name], rtol=1e-9, atol=0)
    torch.testing.assert_close(got.projection, want.projection, rtol=1e-6, atol=0)
    for name in want.routed_tokens:
        assert torch.equal(got.routed_tokens[name], want.routed_tokens[name])


def test_score_with_device_map_equals_score_without_and_records_the_placement(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    runs = {None: gradspec.score(data, str(tiny_model_dir), tmp_path / "None.parquet", max_length=64,
                                 progress=False)}
    assert main(["score", "--data", str(data), "--model", str(tiny_model_dir), "--out", str(tmp_path / "auto.parquet"),
                 "--max-length", "64", "--quiet", "--device-map", "auto"]) == 0
    runs["auto"] = pd.read_parquet(tmp_path / "auto.parquet")
    assert (runs["auto"]["status"] == "ok").all()
    metrics = [c for c in runs[None].columns if "/" in c]
    assert len(metrics) > 0
    assert runs["auto"][metrics].equals(runs[None][metrics])
    sharding = read_metadata(tmp_path / "auto.parquet")["sharding"]
    assert sharding == {"mode": "device_map", "strategy": "auto", "devices": {"": "cpu"}}  # all of it fits
    assert "sharding" not in read_metadata(tmp_path / "None.parquet")


def test_device_map_is_refused_with_a_device_or_under_torchrun(tmp_path, tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="leave device"):
        gradspec.score(None, str(tiny_model_dir), device="cuda", device_map="auto", limit=1)
    with pytest.raises(ValueError, match="device_map must be one of auto"):
        gradspec.score(None, str(tiny_model_dir), device_map="everywhere", limit=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="use fsdp to shard"):
        gradspec.score(None, str(tiny_model_dir), tmp_path / "s.parquet", device_map="auto", limit=1)
