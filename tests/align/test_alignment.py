"""Exact gradient alignment against materialised per-sample gradients: every layout, both routes,
every aggregate; a sample's cosines do not depend on its batch-mates or its padding."""

import logging

import pytest
import torch
from conftest import padded_batch, random_sequences, tiny_model

from gradspec.engine.loss import response_loss_per_sample
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.targets import select_targets

VOCAB = 500
POOL = [5, 17, 40, 90]
TASK = [7, 30, 12]
ALL = ("mean_gradient", "mean", "max")


def materialised(model, sequences, modules) -> list[dict[str, torch.Tensor]]:
    """Each sample's parameter gradient per part, by a backward of its own loss alone."""
    targets = select_targets(model, modules)
    out = []
    for ids, labels in sequences:
        model.requires_grad_(False)
        for t in targets:
            t.module.weight.requires_grad_(True)
            t.module.weight.grad = None
        loss, _ = response_loss_per_sample(model(input_ids=ids[None], use_cache=False).logits, labels[None])
        loss.sum().backward()
        grads = {}
        for t in targets:
            w = t.module.weight.grad.T if t.transposed else t.module.weight.grad
            grads.update({p.name: w[p.start : p.start + p.d_out].double().clone() for p in t.parts})
        out.append(grads)
    model.requires_grad_(False)
    return out


def expected_cosines(pool, task, names) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(mean_gradient, mean, max) per part and over the concatenated parts, from full gradients."""
    def three(g, examples):
        mean = sum(examples) / len(examples)
        cos = [float((g * t).sum() / (g.norm() * t.norm())) for t in examples]
        return [float((g * mean).sum() / (g.norm() * mean.norm())), sum(cos) / len(cos), max(cos)]

    per_part = {n: torch.tensor([three(g[n], [t[n] for t in task]) for g in pool], dtype=torch.float64) for n in names}
    flat = lambda g: torch.cat([g[n].flatten() for n in names])  # noqa: E731
    model = torch.tensor([three(flat(g), [flat(t) for t in task]) for g in pool], dtype=torch.float64)
    return per_part, model


@pytest.mark.parametrize("route", ["dense", "cross"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "phi3"])  # GQA; Conv1D with fused q/k/v; fused qkv and gate/up
def test_cosines_equal_those_of_materialised_gradients(kind, route):
    model = tiny_model(kind, vocab=VOCAB).double()  # fp64 end to end: the reference's own rounding is negligible
    pool, task = random_sequences(POOL, VOCAB, seed=1), random_sequences(TASK, VOCAB, seed=2)
    want_parts, want_model = None, None
    for aggregates in (ALL, ("mean_gradient", "mean"), ("mean",)):
        engine = SpectralEngine(model, "all", spectra=False)
        engine.set_task([padded_batch(task[:2]), padded_batch(task[2:])], aggregates, route=route)
        assert {d.route for d in engine.task.parts.values()} == {route}
        scores = engine.score(*padded_batch(pool))
        if want_parts is None:
            want_parts, want_model = expected_cosines(materialised(model, pool, "all"),
                                                      materialised(model, task, "all"), engine.part_names)
        columns = [ALL.index(a) for a in aggregates]
        assert engine.metric_names == tuple(f"align_{a}" for a in aggregates)
        for name in engine.part_names:
            torch.testing.assert_close(scores.metrics[name], want_parts[name][:, columns], rtol=1e-9, atol=1e-12)
        got_model = torch.stack([scores.alignment[f"align_{a}"] for a in aggregates], 1)
        torch.testing.assert_close(got_model, want_model[:, columns], rtol=1e-9, atol=1e-12)
        assert all(scores.status(i) == "ok" for i in range(len(pool)))


def test_the_automatic_route_depends_on_the_sizes():
    model = tiny_model("llama", vocab=VOCAB)
    engine = SpectralEngine(model, "all", spectra=False)
    engine.set_task([padded_batch(random_sequences([6, 5], VOCAB))])  # 11 task tokens: cross-Grams are cheaper
    assert {d.route for d in engine.task.parts.values()} == {"cross"}
    engine.set_task([padded_batch(random_sequences([300, 290], VOCAB))])  # longer than the layers are wide
    assert {d.route for d in engine.task.parts.values()} == {"dense"}


def test_batch_mates_and_padding_do_not_change_a_sample():
    model = tiny_model("qwen2", vocab=VOCAB).double()  # fp32 forwards round differently per batch shape
    pool, task = random_sequences(POOL, VOCAB, seed=3), random_sequences(TASK, VOCAB, seed=4)
    engine = SpectralEngine(model, "attn", spectra=False)
    engine.set_task([padded_batch(task)], ALL)
    together = engine.score(*padded_batch(pool))
    for i, sample in enumerate(pool):
        ids, mask, labels = padded_batch([sample])
        pad = 7  # extra right padding
        alone = engine.score(torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(mask, (0, pad)),
                             torch.nn.functional.pad(labels, (0, pad), value=-100))
        for name, values in together.metrics.items():
            torch.testing.assert_close(alone.metrics[name][0], values[i], rtol=1e-10, atol=1e-12)
        for name, values in together.alignment.items():
            torch.testing.assert_close(alone.alignment[name][0], values[i], rtol=1e-10, atol=1e-12)


def test_spectra_and_alignment_in_one_pass_equal_each_alone():
    model = tiny_model("llama", vocab=VOCAB)
    pool, task = random_sequences(POOL, VOCAB, seed=5), padded_batch(random_sequences(TASK, VOCAB, seed=6))
    spectra_alone = SpectralEngine(model, "attn").score(*padded_batch(pool))
    alone = SpectralEngine(model, "attn", spectra=False)
    alone.set_task([task])
    alignment_alone = alone.score(*padded_batch(pool))
    both = SpectralEngine(model, "attn")
    both.set_task([task])
    together = both.score(*padded_batch(pool))
    n = len(spectra_alone.metrics[both.part_names[0]][0])
    for name in both.part_names:
        assert torch.equal(together.metrics[name][:, :n], spectra_alone.metrics[name])
        assert torch.equal(together.metrics[name][:, n:], alignment_alone.metrics[name])
    assert together.alignment.keys() == alignment_alone.alignment.keys()
    assert all(torch.equal(together.alignment[k], v) for k, v in alignment_alone.alignment.items())


def test_unusable_examples_are_left_out_and_unscored_samples_flagged(caplog):
    model = tiny_model("llama", vocab=VOCAB).double()
    task = random_sequences(TASK, VOCAB, seed=7)
    silent = (task[1][0], torch.full_like(task[1][1], -100))  # no response tokens
    engine = SpectralEngine(model, "attn", spectra=False)
    with caplog.at_level(logging.WARNING, logger="gradspec"):
        engine.set_task([padded_batch([task[0], silent, task[2]])], ALL)
    assert "[1]" in caplog.text and engine.task.kept.tolist() == [True, False, True]
    pool = random_sequences([9, 14], VOCAB, seed=8)
    pool[1] = (pool[1][0], torch.full_like(pool[1][1], -100))
    scores = engine.score(*padded_batch(pool))
    reference = SpectralEngine(model, "attn", spectra=False)
    reference.set_task([padded_batch([task[0], task[2]])], ALL)
    want = reference.score(*padded_batch(pool[:1]))
    for name, values in want.metrics.items():
        torch.testing.assert_close(scores.metrics[name][:1], values, rtol=1e-10, atol=1e-12)
    assert scores.status(0) == "ok" and scores.status(1) == "no_response_tokens"
    assert all(torch.isnan(v[1]).all() for v in scores.metrics.values())
    with pytest.raises(ValueError, match="none of the 1 task examples"):
        engine.set_task([padded_batch([silent])])
    with pytest.raises(ValueError, match="--aggregate takes"):
        engine.set_task([padded_batch(task)], "median")


def test_the_model_is_left_as_it_was_found():
    model = tiny_model("llama", vocab=VOCAB).train()
    model.requires_grad_(True)
    engine = SpectralEngine(model, "attn", spectra=False)
    engine.set_task([padded_batch(random_sequences(TASK, VOCAB))])
    engine.score(*padded_batch(random_sequences(POOL, VOCAB)))
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())
