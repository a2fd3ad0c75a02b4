"""Capture under activation checkpointing (transformers' gradient_checkpointing, re-entrant and
not): the same spectra as without it, the inputs taken from the recompute and not held."""

import pytest
import torch
from conftest import MOE_KINDS, padded_batch, random_sequences, tiny_model
from torch import nn

from gradspec.engine.capture import BatchCapture
from gradspec.engine.loss import response_losses
from gradspec.layers import checkpointing
from gradspec.layers.hooks import BatchLayout, attached
from gradspec.layers.targets import select_targets
from gradspec.linalg.metrics import metric_names

VOCAB = 300
LENGTHS = [9, 30, 41]  # on both sides of the parts' smaller sizes: the core and the materialised path


def spectra(model, modules: str, batch, eager: bool = False, held: list | None = None) -> dict[str, torch.Tensor]:
    """One training-mode forward and backward with the hooks on through the backward, as the monitor
    runs it; held gets the number of core groups whose Grams are still held after the backward."""
    ids, mask, labels = batch
    targets = select_targets(model, modules)
    capture = BatchCapture(targets, BatchLayout(mask.sum(1), "cpu"), "auto", None, metric_names(), eager=eager)
    with attached(model, [capture]):
        loss, count, _ = response_losses(model, ids, mask, labels)
        loss.sum().backward()
    if held is not None:
        held.append(len(capture.core))
    capture.to_host()
    metrics, _ = capture.reduce(torch.ones(len(ids), dtype=torch.bool), [set() for _ in ids], keep_spectra=False)
    return metrics


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_checkpointed_rows_equal_plain_rows(family, reentrant):
    model = tiny_model(family, vocab=VOCAB).train()
    model = model if family in MOE_KINDS else model.double()  # grouped_mm has no fp64 kernel
    batch = padded_batch(random_sequences(LENGTHS, VOCAB, seed=4))
    plain = spectra(model, "all", batch)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    if reentrant:  # re-entrant checkpointing needs an input that requires grad to build the graph
        model.enable_input_require_grads()
    checkpointed = spectra(model, "all", batch)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    rtol = 1e-6 if family in MOE_KINDS else 1e-9
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=rtol, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize(("family", "modules"), [("llama", "all"), ("qwen3_moe", "experts")])
def test_eager_eigen_stage_frees_each_input_s_grams_during_the_backward(family, modules):
    """Under checkpointing each input's parts are solved once the input is gone, unasked (an experts
    module's stacked segments once every part reading them is delivered): after the backward only the first
    layer's groups (whose inputs live until the end) are left, same rows as without checkpointing, where
    every group is held to the end."""
    model = tiny_model(family, vocab=VOCAB).train()
    model = model if family in MOE_KINDS else model.double()  # grouped_mm, MoE's default, has no fp64 kernel
    batch = padded_batch(random_sequences(LENGTHS, VOCAB, seed=6))
    held_late, held_eager = [], []
    late = spectra(model, modules, batch, held=held_late)
    model.activation_checkpointing_enable({"use_reentrant": False})
    eager = spectra(model, modules, batch, held=held_eager)
    layers = model.config.num_hidden_layers
    assert held_eager[0] <= held_late[0] // layers < held_late[0]
    for name, value in late.items():
        torch.testing.assert_close(eager[name], value, rtol=1e-12, atol=0, equal_nan=True, msg=name)


def test_frozen_lower_layers_under_checkpointing():
    """Where a scored module's input needs no gradient (frozen embeddings and first layer), its output
    starts the graph in the recompute as in the first run: both save the same tensors."""
    model = tiny_model("llama", vocab=VOCAB).double().train()
    for p in [*model.model.embed_tokens.parameters(), *model.model.layers[0].parameters()]:
        p.requires_grad_(False)
    batch = padded_batch(random_sequences(LENGTHS, VOCAB, seed=5))
    plain = spectra(model, "all", batch)
    model.activation_checkpointing_enable({"use_reentrant": False})
    checkpointed = spectra(model, "all", batch)
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-9, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize(("family", "modules", "per_layer"), [("llama", "attn", 4), ("qwen3_moe", "experts", 2)])
def test_the_first_run_holds_no_input_and_the_recompute_supplies_it(monkeypatch, family, modules, per_layer):
    """Without checkpointing each call holds its X until its D arrives; under non-reentrant
    checkpointing the first run's calls hold nothing: X comes from the recompute, paired by call
    (q, k, v, o; an experts module's up and down projections, whose rows equal the plain run's)."""
    held = []
    original = checkpointing.Pairing.recomputed

    def recomputed(self, frame, X, done):
        held.append(X.shape)
        return original(self, frame, X, done)

    monkeypatch.setattr(checkpointing.Pairing, "recomputed", recomputed)
    model = tiny_model(family, vocab=VOCAB).train()
    model = model if family in MOE_KINDS else model.double()  # grouped_mm has no fp64 kernel
    batch = padded_batch(random_sequences(LENGTHS, VOCAB, seed=4))
    plain = spectra(model, modules, batch)
    assert not held
    model.activation_checkpointing_enable({"use_reentrant": False})
    checkpointed = spectra(model, modules, batch)
    layers = model.config.num_hidden_layers
    assert len(held) == per_layer * layers  # every call's input from its region's recompute
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-6, atol=0, equal_nan=True, msg=name)


def test_a_recomputed_input_does_not_match_a_freed_one_at_the_same_address():
    from gradspec.layers.hooks import input_key

    x = torch.randn(4, 8)
    key = input_key(x)
    assert key == input_key(x.detach()) and key == input_key(x.view(4, 8))
    ptr = x.data_ptr()
    del x
    y = torch.empty(4, 8)
    if y.data_ptr() == ptr:  # the allocator reused the address: the dead key must not match
        assert key != input_key(y)
    assert key != input_key(torch.randn(4, 8))


class _TwiceUsed(nn.Module):
    """q_proj called twice in one forward: its gradient is a sum over both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(6, 6).double(), nn.Linear(6, 6).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_proj(torch.tanh(self.q_proj(x)))))


@pytest.mark.parametrize("backwards", [1, 2], ids=["called twice", "two backwards"])
def test_a_module_whose_gradient_sums_several_calls_is_flagged_not_half_scored(backwards):
    torch.manual_seed(0)
    model = _TwiceUsed() if backwards == 1 else nn.Sequential()
    if backwards == 2:  # one call, two backwards through it (retain_graph)
        model.q_proj = nn.Linear(6, 6).double()
    capture = BatchCapture(select_targets(model, "q,o" if backwards == 1 else "q"), BatchLayout(torch.tensor([5, 5]),
                           "cpu"), "auto", None, metric_names())
    x = torch.randn(2, 5, 6, dtype=torch.double, requires_grad=True)
    with attached(model, [capture]):
        out = (model.q_proj(x) if backwards == 2 else model(x)).pow(2).sum()
        for _ in range(backwards):
            out.backward(retain_graph=True)
    capture.to_host()
    flags = [set(), set()]
    metrics, _ = capture.reduce(torch.ones(2, dtype=torch.bool), flags, keep_spectra=False)
    assert flags == [{"repeated_call"}] * 2 and metrics["q_proj"].isnan().all()
    if backwards == 1:
        assert metrics["o_proj"].isfinite().all()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_any_torch_checkpointing_frees_each_input_s_grams_during_the_backward(reentrant):
    """torch's own checkpoint wrapper (what FSDP users apply; transformers' flag is not set): the hooks find
    themselves in a checkpointed region and the eigen stage runs as each input goes, unasked; same rows."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = tiny_model("llama", vocab=VOCAB).double().train()
    batch = padded_batch(random_sequences(LENGTHS, VOCAB, seed=6))
    held_plain, held = [], []
    plain = spectra(model, "all", batch, held=held_plain)
    layer = type(model.model.layers[0])
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, layer))
    if reentrant:
        model.enable_input_require_grads()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    checkpointed = spectra(model, "all", batch, held=held)  # named as the model names them, not the wrapper
    assert held[0] <= held_plain[0] // model.config.num_hidden_layers < held_plain[0]
    assert plain.keys() == checkpointed.keys()
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-9, atol=0, equal_nan=True, msg=name)
