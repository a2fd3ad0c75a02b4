"""Preconditioned exact attribution (K-FAC, EK-FAC, Adam) against the materialised reference: each
pool sample's and task example's parameter gradient by autograd, the preconditioner applied to them
explicitly, then the inner products and cosines, in fp64."""

import pytest
import torch
from conftest import materialised_gradients, padded_batch, random_sequences, tiny_model

from gradspec.alignment.adam import AdamState
from gradspec.alignment.kfac import KFACFactors, fit_factors
from gradspec.alignment.preconditioner import Preconditioner
from gradspec.engine.reference import parameter_gradients
from gradspec.engine.spectral_engine import SpectralEngine

VOCAB = 500
POOL = [5, 17, 40, 9]
TASK = [7, 30, 12]
FIT = [11, 25, 8, 19, 33, 6]
ALL = ("mean_gradient", "mean", "max")
DAMPING = 0.1


def _expected(pool: list[dict], task: list[dict], names: list[str], routed: set[str]):
    """(attribution (N, m), per-part cosines {part: (N, 3)}, whole-model cosines (N, 3)) from the
    gradients as preconditioned (pool side, task side)."""
    def three(g, examples):
        mean = sum(examples) / len(examples)
        cos = [float((g * t).sum() / (g.norm() * t.norm())) for t in examples]
        return [float((g * mean).sum() / (g.norm() * mean.norm())), sum(cos) / len(cos), max(cos)]

    flat = lambda g: torch.cat([g[n].flatten() for n in names])  # noqa: E731
    attribution = torch.tensor([[float(flat(g) @ flat(t)) for t in task] for g in pool], dtype=torch.float64)
    per_part = {n: torch.tensor([three(g[n], [t[n] for t in task]) for g in pool], dtype=torch.float64)
                for n in names if n not in routed}
    model = torch.tensor([three(flat(g), [flat(t) for t in task]) for g in pool], dtype=torch.float64)
    return attribution, per_part, model


def _kfac_reference(factors: KFACFactors, name: str, G: torch.Tensor) -> torch.Tensor:
    """(A_d ⊗ S_d)^-1 vec(G) = S_d^-1 G A_d^-1, by solves (not the eigenvectors the code uses)."""
    def damped(F):
        return F + DAMPING * torch.trace(F) / len(F) * torch.eye(len(F), dtype=F.dtype)

    A, S = damped(factors.A[name].double()), damped(factors.S[name].double())
    return torch.linalg.solve(S, torch.linalg.solve(A, G.T).T)


def _ekfac_reference(factors: KFACFactors, name: str, G: torch.Tensor, fit: list[dict]) -> torch.Tensor:
    """Λ = mean over the fitting examples of (Q_S^T G_i Q_A)^2 from their materialised gradients."""
    Q_A, Q_S = factors.bases(name)
    L = sum((Q_S.T @ g[name] @ Q_A) ** 2 for g in fit) / len(fit)
    return Q_S @ ((Q_S.T @ G @ Q_A) / (L + DAMPING * L.mean())) @ Q_A.T


def _adam_reference(state: AdamState, part, G: torch.Tensor) -> torch.Tensor:
    (b1, b2), t = state.betas, state.step + 1
    m, v = (part.slice(x).double() for x in state.moments[part.parameter])
    return ((b1 * m + (1 - b1) * G) / (1 - b1**t)) / (((b2 * v + (1 - b2) * G**2) / (1 - b2**t)).sqrt() + state.eps)


def _random_adam_state(model, parts, seed: int = 5) -> AdamState:
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    moments = {}
    for name in dict.fromkeys(p.parameter for p in parts):
        shape = params[name].shape
        moments[name] = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e-3,
                         torch.rand(shape, generator=g, dtype=torch.float64) * 1e-5)
    return AdamState(moments, (0.9, 0.999), 1e-8, 2e-5, 7, "random")


@pytest.mark.parametrize("kind", ["kfac", "ekfac", "adam"])
@pytest.mark.parametrize("model_kind", ["llama", "qwen2", "qwen3_moe"])
def test_preconditioned_attribution_equals_the_materialised_reference(model_kind, kind):
    model = tiny_model(model_kind, vocab=VOCAB)
    if model_kind == "qwen3_moe":
        model.set_experts_implementation("eager")  # grouped_mm, the default, has no fp64 kernel
    model = model.double()  # fp64 end to end
    modules = "all"
    pool, task = random_sequences(POOL, VOCAB, seed=1), random_sequences(TASK, VOCAB, seed=2)
    fit_set = random_sequences(FIT, VOCAB, seed=3)
    engine = SpectralEngine(model, modules, spectra=False)
    parts = {p.name: p for p in engine.parts}
    routed = {p.name for p in engine.parts if p.routed}
    pool_g, task_g = materialised_gradients(model, pool, modules), materialised_gradients(model, task, modules)
    if kind == "adam":
        state = _random_adam_state(model, engine.parts)
        pre = Preconditioner("adam", state.updates(engine.parts))
        pool_g = [{n: _adam_reference(state, parts[n], g[n]) for n in g} for g in pool_g]
    else:
        factors = fit_factors(engine.backward_pass, engine.targets,
                              [padded_batch(fit_set[:3]), padded_batch(fit_set[3:])], kind)
        pre = Preconditioner(kind, factors.inverses(DAMPING))
        if kind == "kfac":
            task_g = [{n: _kfac_reference(factors, n, g[n]) for n in g} for g in task_g]
        else:
            fit_g = materialised_gradients(model, fit_set, modules)
            task_g = [{n: _ekfac_reference(factors, n, g[n], fit_g) for n in g} for g in task_g]
    want_attribution, want_parts, want_model = _expected(pool_g, task_g, engine.part_names, routed)
    routes = ["dense", "cross"] if kind == "kfac" else ["dense"]
    for route in routes:
        engine.set_task([padded_batch(task[:2]), padded_batch(task[2:])], ALL, route=route, preconditioner=pre,
                        attribution=True)
        assert {d.route for d in engine.task.parts.values()} == {route}
        scores = engine.score(*padded_batch(pool))
        torch.testing.assert_close(scores.attribution, want_attribution, rtol=1e-9, atol=1e-12)
        got_model = torch.stack([scores.alignment[f"align_{a}"] for a in ALL], 1)
        torch.testing.assert_close(got_model, want_model, rtol=1e-9, atol=1e-12)
        for name, want in want_parts.items():
            torch.testing.assert_close(scores.metrics[name], want, rtol=1e-9, atol=1e-12)


def test_the_fitted_factors_are_the_token_means_of_the_layers_inputs_and_output_gradients():
    """A and S of each q_proj against torch's own module hooks: mean over valid tokens of x x^T and δ δ^T."""
    model = tiny_model("llama", vocab=VOCAB).double()
    fit_set = random_sequences(FIT, VOCAB, seed=3)
    engine = SpectralEngine(model, "q", spectra=False)
    factors = fit_factors(engine.backward_pass, engine.targets, [padded_batch(fit_set)], "kfac")
    for layer in model.model.layers:
        xs, ds = [], []
        module = layer.self_attn.q_proj
        handles = [module.register_forward_hook(lambda m, i, o, xs=xs: xs.append(i[0][0])),
                   module.register_full_backward_hook(lambda m, gi, go, ds=ds: ds.append(go[0][0]))]
        try:
            for ids, labels in fit_set:
                parameter_gradients(model, ids, labels, "q")
        finally:
            for h in handles:
                h.remove()
        X, D = torch.cat(xs), torch.cat(ds)
        name = next(p.name for p in engine.parts if p.parameter.startswith(
            next(n for n, m in model.named_modules() if m is module)))
        torch.testing.assert_close(factors.A[name], X.T @ X / len(X), rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(factors.S[name], D.T @ D / len(D), rtol=1e-10, atol=1e-14)


def test_factors_are_stored_and_read_back_exactly_and_refused_for_other_parts(tmp_path):
    model = tiny_model("llama", vocab=VOCAB).double()
    engine = SpectralEngine(model, "attn", spectra=False)
    factors = fit_factors(engine.backward_pass, engine.targets, [padded_batch(random_sequences(FIT, VOCAB))],
                          "ekfac", {"data": "fit.jsonl"})
    path = tmp_path / "factors.safetensors"
    path.write_bytes(factors.to_bytes())
    back = KFACFactors.load(path, engine.parts)
    assert back.kind == "ekfac" and back.provenance == factors.provenance
    # q, k and v read one input: one A for the three, decomposed and stored once (o reads another)
    for found in (factors, back):
        assert len({id(t) for t in found.A.values()}) == 2 * len(model.model.layers)
    for name in factors.A:
        assert torch.equal(back.A[name], factors.A[name]) and torch.equal(back.S[name], factors.S[name])
        assert torch.equal(back.eigenvalues[name], factors.eigenvalues[name])
    other = SpectralEngine(model, "mlp", spectra=False)
    with pytest.raises(ValueError, match="factors.safetensors: no A .* for .*mlp"):
        KFACFactors.load(path, other.parts)


def test_a_task_side_preconditioner_is_refused_the_cross_route_where_it_is_not_kronecker():
    model = tiny_model("llama", vocab=VOCAB).double()
    engine = SpectralEngine(model, "attn", spectra=False)
    state = _random_adam_state(model, engine.parts)
    with pytest.raises(ValueError, match="adam preconditioner needs each gradient formed"):
        engine.set_task([padded_batch(random_sequences(TASK, VOCAB))], route="cross",
                        preconditioner=Preconditioner("adam", state.updates(engine.parts)))
