"""The memory model that sizes batches (gradspec.engine.batch_memory) and its use by score."""

import pytest
import torch
from conftest import tiny_model

from gradspec.data.batching import Item, token_batches
from gradspec.data.readers import Sample
from gradspec.data.templates import Tokenized
from gradspec.engine import batch_memory
from gradspec.engine.batch_memory import BatchMemory
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.runs import api, chunks
from gradspec.runs.chunks import score_samples


def _model(attention: str, seed: int = 0) -> torch.nn.Module:
    model = tiny_model("llama", vocab=300, seed=seed)
    model.config._attn_implementation = attention
    return model


def test_the_inputs_and_their_parts_are_the_engines():
    """q, k and v share one input (one X X^T), o has its own; each part's smaller side is min(d_in, d_out)."""
    memory = batch_memory.measure(SpectralEngine(_model("sdpa"), "attn"), 0)
    # 2 layers; d = 64, 2 of 4 heads for k and v: 32 outputs
    assert sorted(memory.inputs) == [(32, 32, 64), (32, 32, 64), (64,), (64,)]
    assert memory.per_token > 0
    lowrank = batch_memory.measure(SpectralEngine(_model("sdpa"), "attn", method="lowrank", rank=4), 0)
    assert lowrank.inputs == () and lowrank.gram_elements(100) == 0


def test_eager_attention_adds_a_quadratic_term_that_sdpa_does_not():
    """Eager attention keeps each layer's T x T probabilities per head: the probes find them."""
    eager = batch_memory.measure(SpectralEngine(_model("eager"), "attn"), 0)
    sdpa = batch_memory.measure(SpectralEngine(_model("sdpa"), "attn"), 0)
    layers_heads_fp32 = 2 * 4 * 4
    assert eager.per_token_pair >= layers_heads_fp32
    assert sdpa.per_token_pair < layers_heads_fp32 / 4
    assert eager.per_token == pytest.approx(sdpa.per_token, rel=0.5)


def test_grams_follow_the_engines_split():
    """T x T cores while T is below a part's smaller side; past it, the Gram of G at that side, and no
    X X^T once every part of an input is materialised."""
    memory = BatchMemory(0.0, 0.0, ((32, 64),))
    assert memory.gram_elements(10) == 3 * 10 * 10
    assert memory.gram_elements(40) == 40 * 40 + 32 * 32 + 40 * 40
    assert memory.gram_elements(100) == 32 * 32 + 64 * 64
    assert memory.bytes(3, 10) == 2 * 3 * 8 * 300


def _items(lengths: list[int]) -> list[Item]:
    return [Item(Sample(i, [], {}), Tokenized([1] * n, [1] * n, "ok")) for i, n in enumerate(lengths)]


def test_batches_fit_the_memory_model_and_a_sample_too_large_runs_alone():
    memory = BatchMemory(1000.0, 0.0, ((16,),))
    budget = memory.bytes(3, 40)
    batches = list(token_batches(_items([40] * 7 + [400]), 10**6, fits=lambda n, T: memory.fits(n, T, budget)))
    assert [len(b) for b in batches] == [3, 3, 1, 1]
    assert all(memory.bytes(len(b), b[-1].tokens.num_tokens) <= budget for b in batches[:-1])


def test_score_plans_batches_within_the_memory_available_and_rows_do_not_change(monkeypatch, tokenizer):
    """With little memory available, score's batches shrink to the plan (the engine sees only batches that
    fit it) and every row equals the one with memory to spare, but for the last bits a batch's shape
    decides (docs/runs-at-scale.md#what-is-bit-identical: 3e-9 relative on a 2-core AMD EPYC, none on
    the Xeon)."""
    samples = [Sample(i, [{"role": "user", "content": "word " * (3 + i)}, {"role": "assistant", "content": "ok " * 9}],
                      {}) for i in range(12)]

    def run(available: int) -> tuple[list[dict], list[tuple[int, int]]]:
        engine = SpectralEngine(tiny_model("llama"), "attn")
        shapes, submit = [], engine.submit
        monkeypatch.setattr(engine, "submit", lambda ids, *rest: shapes.append(tuple(ids.shape)) or submit(ids, *rest))
        monkeypatch.setattr(batch_memory, "available_bytes", lambda device: available)
        rows: list[dict] = []
        with engine:
            score_samples(samples, engine, tokenizer, lambda _, chunk: rows.extend(chunk), progress=False)
        return rows, shapes

    roomy, roomy_shapes = run(1 << 40)
    plan = chunks._BatchPlan(SpectralEngine(tiny_model("llama"), "attn"), 0)
    plan.fits(1, 1)
    tight = plan.memory.bytes(2, max(s[1] for s in roomy_shapes))  # about two rows of the longest batch
    rows, shapes = run(int(tight / batch_memory.HEADROOM))
    assert len(roomy_shapes) <= 2 and len(shapes) >= 6
    assert all(plan.memory.bytes(n, T) <= tight for n, T in shapes)
    assert [r["index"] for r in rows] == [r["index"] for r in roomy]
    for a, b in zip(rows, roomy, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == (b[key] if isinstance(b[key], str) else pytest.approx(b[key], rel=1e-7, nan_ok=True)), key


def test_the_plan_stands_aside_for_a_model_on_several_devices_or_in_lockstep():
    engine = SpectralEngine(tiny_model("llama"), "attn")
    engine.lockstep = object()
    assert chunks._BatchPlan(engine, 0).fits(10**6, 10**6)
    model = tiny_model("llama")
    model.hf_device_map = {"": "cpu"}
    assert chunks._BatchPlan(SpectralEngine(model, "attn"), 0).fits(10**6, 10**6)


def test_score_batches_1024_tokens_on_the_cpu_by_default(monkeypatch, tiny_model_dir):
    """On the CPU 1,024 padded tokens score as fast as 4,096 in a fraction of the memory; on a GPU 4,096."""
    from gradspec.data.batching import batch_tokens_for

    assert batch_tokens_for("cpu") == batch_tokens_for(None) == 1024
    assert batch_tokens_for("cuda:1") == batch_tokens_for("cpu", device_map="auto") == 4096
    budgets = []
    real = chunks.token_batches
    monkeypatch.setattr(chunks, "token_batches",
                        lambda items, tokens, **k: budgets.append(tokens) or real(items, tokens, **k))
    api.score(model=str(tiny_model_dir), limit=3, progress=False)
    api.score(model=str(tiny_model_dir), limit=3, progress=False, batch_tokens=300)
    assert budgets == [1024, 300]
