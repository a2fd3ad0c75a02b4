"""Exact gradient alignment against materialised per-sample gradients: every layout, both routes,
every aggregate; a sample's cosines do not depend on its batch-mates or its padding."""

import logging

import pytest
import torch
from conftest import materialised_gradients, padded_batch, random_sequences, tiny_model

from gradspec.alignment.directions import route_for
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.experts import ExpertsTarget

VOCAB = 500
POOL = [5, 17, 40, 90]
TASK = [7, 30, 12]
ALL = ("mean_gradient", "mean", "max")


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
            want_parts, want_model = expected_cosines(materialised_gradients(model, pool, "all"),
                                                      materialised_gradients(model, task, "all"), engine.part_names)
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


@pytest.mark.parametrize("route", ["dense", "cross"])
def test_unusable_examples_are_left_out_and_unscored_samples_flagged(caplog, route):
    """A task example without response tokens, and one whose forward overflows (NaN inputs to every
    later layer: a NaN times a zero coefficient would still spread), are left out; the pool's
    cosines are those of the task without them. Pool rows without a loss are NaN and flagged."""
    model = tiny_model("llama", vocab=VOCAB).double()
    task = random_sequences([7, 30, 12, 9], VOCAB, seed=7)
    silent = (task[1][0], torch.full_like(task[1][1], -100))  # no response tokens
    engine = SpectralEngine(model, "all", spectra=False)

    def overflow(module, args, output):  # the fourth example's forward turns NaN (not the head check's)
        if len(output) < 4:
            return output
        output = output.clone()
        output[3] = torch.nan
        return output

    hook = model.get_input_embeddings().register_forward_hook(overflow)
    try:
        with caplog.at_level(logging.WARNING, logger="gradspec"):
            engine.set_task([padded_batch([task[0], silent, task[2], task[3]])], ALL, route=route)
    finally:
        hook.remove()
    assert "[1, 3]" in caplog.text and engine.task.kept.tolist() == [True, False, True, False]
    pool = random_sequences([9, 14], VOCAB, seed=8)
    pool[1] = (pool[1][0], torch.full_like(pool[1][1], -100))
    scores = engine.score(*padded_batch(pool))
    clean = SpectralEngine(model, "all", spectra=False)
    clean.set_task([padded_batch([task[0], task[2]])], ALL, route=route)
    want = clean.score(*padded_batch(pool[:1]))
    for name, values in want.metrics.items():
        torch.testing.assert_close(scores.metrics[name][:1], values, rtol=1e-10, atol=1e-12)
    for name, values in want.alignment.items():
        torch.testing.assert_close(scores.alignment[name][:1], values, rtol=1e-10, atol=1e-12)
    assert scores.status(0) == "ok" and scores.status(1) == "no_response_tokens"
    assert all(torch.isnan(v[1]).all() for v in scores.metrics.values())
    assert all(torch.isnan(v[1]) for v in scores.alignment.values())
    with pytest.raises(ValueError, match="none of the 1 task examples"):
        engine.set_task([padded_batch([silent])])
    with pytest.raises(ValueError, match="aggregate takes"):
        engine.set_task([padded_batch(task)], "median")


def test_a_batch_without_any_loss_gives_nan_not_an_error():
    model = tiny_model("llama", vocab=VOCAB)
    engine = SpectralEngine(model, "attn", spectra=False, project=3)
    engine.set_task([padded_batch(random_sequences(TASK, VOCAB))], ALL)
    ids, labels = random_sequences([8], VOCAB)[0]
    scores = engine.score(*padded_batch([(ids, torch.full_like(labels, -100))]))
    assert scores.status(0) == "no_response_tokens"
    assert all(torch.isnan(v).all() for v in scores.metrics.values())
    assert all(torch.isnan(v).all() for v in scores.alignment.values()) and torch.isnan(scores.projection).all()


def test_directions_that_would_not_fit_move_to_the_cross_route_or_stop():
    """Eight short examples with "max": one 64 x 64 matrix per example and part on the dense route
    (the cheaper in operations), more than their 80 rows on the cross one. Half the budget moves
    parts to cross, with the same cosines; a budget nothing fits in stops with the estimate."""
    model = tiny_model("llama", vocab=VOCAB).double()
    task = [padded_batch(random_sequences([10] * 8, VOCAB, seed=9))]
    pool = padded_batch(random_sequences(POOL, VOCAB, seed=10))
    engine = SpectralEngine(model, "all", spectra=False)
    dense = engine.set_task(task, ALL)
    assert {d.route for d in dense.parts.values()} == {"dense"}
    want = engine.score(*pool)
    held = sum(d.W.numel() for d in dense.parts.values()) * 8
    from gradspec.alignment.task import collect_task

    engine.task = collect_task(engine.backward_pass, engine.targets, task, ALL, budget_bytes=held // 2)
    routes = [d.route for d in engine.task.parts.values()]
    assert "cross" in routes and "dense" in routes
    assert sum(d.W.numel() * 8 if d.route == "dense" else (d.X.numel() + d.D.numel()) * 8
               for d in engine.task.parts.values()) <= held // 2
    got = engine.score(*pool)
    for name, values in want.metrics.items():
        torch.testing.assert_close(got.metrics[name], values, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="GRADSPEC_TASK_BYTES"):
        collect_task(engine.backward_pass, engine.targets, task, ALL, budget_bytes=1000)


def test_the_model_is_left_as_it_was_found():
    model = tiny_model("llama", vocab=VOCAB).train()
    model.requires_grad_(True)
    engine = SpectralEngine(model, "attn", spectra=False)
    engine.set_task([padded_batch(random_sequences(TASK, VOCAB))])
    engine.score(*padded_batch(random_sequences(POOL, VOCAB)))
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("route", ["dense", "cross"])
def test_smollm2_cosines_equal_those_of_materialised_gradients(smol, route):
    """Real weights (fp32): HumanEval 0-2 against 3-4, two layers' attention and MLP; the tolerance
    is the fp32 parameter gradients' rounding, not ours (ours are fp64 from the same X and D)."""
    from gradspec.data.readers import humaneval_samples
    from gradspec.data.templates import tokenize

    model, tok = smol
    modules = "*.layers.3.self_attn.*,*.layers.29.*"
    seqs = [(torch.tensor(t.input_ids), torch.tensor(t.labels))
            for t in (tokenize(s.messages, tok, "plain", 2048) for s in humaneval_samples(5))]
    pool, task = seqs[:3], seqs[3:]
    engine = SpectralEngine(model, modules, spectra=False)
    engine.set_task([padded_batch(task, tok.pad_token_id)], ALL, route=route)
    scores = engine.score(*padded_batch(pool, tok.pad_token_id))
    want_parts, want_model = expected_cosines(materialised_gradients(model, pool, modules),
                                              materialised_gradients(model, task, modules), engine.part_names)
    assert len(engine.part_names) == 11
    for name in engine.part_names:
        torch.testing.assert_close(scores.metrics[name], want_parts[name], rtol=1e-4, atol=1e-6)
    got_model = torch.stack([scores.alignment[f"align_{a}"] for a in ALL], 1)
    torch.testing.assert_close(got_model, want_model, rtol=1e-4, atol=1e-6)


def test_re_ranking_inside_a_training_loop_follows_the_model():
    """Every few optimizer steps, set_task and score again: the cosines are those of a fresh engine
    on the model as it is then, and training goes on as if the engine were not there."""
    import copy

    model = tiny_model("llama", vocab=VOCAB).double().train()
    twin = copy.deepcopy(model)
    task, pool = padded_batch(random_sequences(TASK, VOCAB, seed=11)), padded_batch(random_sequences(POOL, VOCAB))
    data = [padded_batch(random_sequences([12, 9], VOCAB, seed=s)) for s in range(4)]
    engine = SpectralEngine(model, "attn", spectra=False)

    def step(net, optimizer, batch):
        ids, mask, labels = batch
        net(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    optimizer, twin_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
    for k, batch in enumerate(data):
        step(model, optimizer, batch)
        step(twin, twin_optimizer, batch)
        if k % 2 == 1:
            engine.set_task([task])
            got = engine.score(*pool)
            fresh = SpectralEngine(copy.deepcopy(model).eval(), "attn", spectra=False)
            fresh.set_task([task])
            want = fresh.score(*pool)
            for name, values in want.alignment.items():
                torch.testing.assert_close(got.alignment[name], values, rtol=1e-12, atol=1e-14)
            assert model.training
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def _routed_task_tokens(model, task) -> dict[str, int]:
    """Each expert's task tokens ("<experts module>.<e>" -> count), from a scoring pass over the task."""
    scores = SpectralEngine(model, "experts").score(*padded_batch(task))
    return {name: int(n.sum()) for name, n in scores.routed_tokens.items()}


def _expert_of(engine: SpectralEngine) -> dict[str, str]:
    """Each expert part's routed-token name."""
    return {p.name: f"{t.scored_as}.{t.expert_of(p)}" for t in engine.targets if isinstance(t, ExpertsTarget)
            for p in t.parts}


def test_an_expert_s_route_is_decided_by_the_task_tokens_routed_to_it():
    """The cross route holds only an expert's own task rows: its cost is that of those tokens, not the task's."""
    model = tiny_model("qwen3_moe", vocab=VOCAB)
    task = random_sequences([12, 12], VOCAB, seed=6)
    own = _routed_task_tokens(model, task)
    engine = SpectralEngine(model, "all", spectra=False)
    engine.set_task([padded_batch(task)])
    directions = len(engine.task.parts[engine.parts[0].name].coefficients)
    experts = _expert_of(engine)
    parts = {p.name: p for p in engine.parts}
    for name, expert in experts.items():
        p = parts[name]
        assert engine.task.parts[name].route == route_for(p.d_in, p.d_out, own[expert], directions), name
    assert any(route_for(parts[n].d_in, parts[n].d_out, own[e], directions) !=
               route_for(parts[n].d_in, parts[n].d_out, 24, directions) for n, e in experts.items())


@pytest.mark.parametrize("route", ["dense", "cross", "auto"])
def test_an_expert_the_task_never_reached_has_no_direction_on_any_route(route):
    """A task of one short example leaves some experts unreached: no task gradient there (no crash on the
    cross route, which has no task rows to hold); every value and status as on the dense route."""
    model = tiny_model("qwen3_moe", vocab=VOCAB)
    model.set_experts_implementation("eager")  # grouped_mm, the default, has no fp64 kernel
    model = model.double()
    pool, task = random_sequences(POOL, VOCAB, seed=1), random_sequences([3], VOCAB, seed=2)
    assert 0 in _routed_task_tokens(model, task).values()  # the case under test: an expert it never reached

    def scores(route):
        engine = SpectralEngine(model, "all", spectra=False)
        engine.set_task([padded_batch(task)], route=route)
        return engine.score(*padded_batch(pool))

    got, want = scores(route), scores("dense")
    for name in want.metrics:
        torch.testing.assert_close(got.metrics[name], want.metrics[name], rtol=1e-9, atol=1e-12, equal_nan=True)
    for name in want.alignment:
        torch.testing.assert_close(got.alignment[name], want.alignment[name], rtol=1e-9, atol=1e-12, equal_nan=True)
    assert [got.status(i) for i in range(len(pool))] == [want.status(i) for i in range(len(pool))]
