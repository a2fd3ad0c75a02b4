"""An experts module's parts reach the spectra as stacks of (sample, expert) segments, one per role
and length bucket (gradspec.layers.experts._Layout): the same rows, bit for bit, as per expert, in a
number of Gram, eigen and kernel calls that does not grow with the experts."""

import pytest
import torch
from conftest import MOE_KINDS, padded_batch, random_sequences, tiny_model
from gradspec.kernels import segment_syrk64
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gradspec.alignment.capture import AlignmentCapture
from gradspec.engine import capture
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.registry import Stack

VOCAB = 500


def _per_expert(monkeypatch) -> None:
    """The spectra's capture as one that takes no stacks: each expert's parts delivered alone."""
    monkeypatch.setattr(capture.BatchCapture, "takes_stacks", property(lambda self: False))


def _deliveries(monkeypatch, kind: type = capture.BatchCapture) -> list:
    """(part, lengths) of every part a capture of this kind (the spectra's) is handed, from now on."""
    seen, on_part = [], kind.on_part

    def spy(self, part, captured):
        seen.append((part, captured.lengths.clone()))
        on_part(self, part, captured)

    monkeypatch.setattr(kind, "on_part", spy)
    return seen


@pytest.mark.parametrize("family", list(MOE_KINDS))
def test_stacked_rows_equal_per_expert_rows_bit_for_bit(family, monkeypatch):
    """Samples of 5-70 tokens over 4 experts top-2: segments on the core and the materialised path,
    several buckets; every metric of every part (experts, routers, attention) and every flag the same."""
    model = tiny_model(family, vocab=VOCAB)
    seqs = random_sequences([5, 23, 70, 41], VOCAB, seed=4)
    with monkeypatch.context() as patch:
        seen = _deliveries(patch)
        stacked = SpectralEngine(model, "all", keep_spectra=True).score(*padded_batch(seqs))
    stacks = [(part, lengths) for part, lengths in seen if isinstance(part, Stack)]
    assert stacks and {p.role for p, _ in stacks} == {"expert_gate", "expert_up", "expert_down"} - (
        {"expert_gate"} if family == "olmoe" and not any(p.role == "expert_gate" for p, _ in stacks) else set())
    assert len({p.name for p, _ in stacks}) > 3  # more than one bucket
    _per_expert(monkeypatch)
    alone = SpectralEngine(model, "all", keep_spectra=True).score(*padded_batch(seqs))
    assert stacked.metrics.keys() == alone.metrics.keys()
    for name in alone.metrics:
        torch.testing.assert_close(stacked.metrics[name], alone.metrics[name], rtol=0, atol=0, equal_nan=True)
        for a, b in zip(stacked.spectra[name], alone.spectra[name], strict=True):
            assert (a == b).all() and a.shape == b.shape, name
    assert stacked.flags == alone.flags


def test_beside_an_alignment_the_spectra_still_take_stacks(monkeypatch):
    """score with a task: the spectra's capture gets stacks, the alignment's (which takes none) each
    expert alone, in the same pass; every metric, cosine and flag as where every capture gets each expert alone."""
    model = tiny_model("qwen3_moe", vocab=VOCAB)
    seqs, task = random_sequences([5, 23, 70, 41], VOCAB, seed=4), random_sequences([9, 30], VOCAB, seed=5)

    def run():
        engine = SpectralEngine(model, "all")
        engine.set_task([padded_batch(task)])
        return engine.score(*padded_batch(seqs))

    with monkeypatch.context() as patch:
        spectra, alignment = _deliveries(patch), _deliveries(patch, AlignmentCapture)
        mixed = run()
    assert any(isinstance(p, Stack) for p, _ in spectra)
    assert not any(isinstance(p, Stack) for p, _ in alignment)
    assert {p.role for p, _ in alignment} >= {"expert_gate", "expert_up", "expert_down", "q"}
    _per_expert(monkeypatch)
    alone = run()
    assert mixed.metrics.keys() == alone.metrics.keys() and mixed.alignment.keys() == alone.alignment.keys()
    for name in alone.metrics:
        torch.testing.assert_close(mixed.metrics[name], alone.metrics[name], rtol=0, atol=0, equal_nan=True)
    for name in alone.alignment:
        torch.testing.assert_close(mixed.alignment[name], alone.alignment[name], rtol=0, atol=0, equal_nan=True)
    assert mixed.flags == alone.flags


def test_each_bucket_pads_its_segments_less_than_twice(monkeypatch):
    """Realistic routing (16 experts top-2, samples of 9-120 tokens): each stack's segments differ in
    length by less than 2x, and a layer has at most 1 + log2(longest) buckets per role."""
    model = tiny_model("qwen3_moe", vocab=VOCAB)
    seen = _deliveries(monkeypatch)
    SpectralEngine(model, "experts").score(*padded_batch(random_sequences([9, 33, 120, 64], VOCAB, seed=5)))
    stacks = [(part, lengths) for part, lengths in seen if isinstance(part, Stack)]
    assert len({part.name for part, _ in stacks}) > 3
    for part, lengths in stacks:
        assert lengths.max() < 2 * lengths.min() or lengths.max() == lengths.min(), (part.name, lengths)
        assert len(part.members) == len(lengths)
    per_role: dict = {}
    for part, _ in stacks:
        per_role.setdefault((part.parameter, part.role), set()).add(part.name)
    assert all(len(names) <= 1 + 120 .bit_length() for names in per_role.values())


def _one_layer_moe(experts: int) -> torch.nn.Module:
    """Every token routed to every expert: each (sample, expert) segment is the whole sample."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=12,
                            num_experts=experts, num_experts_per_tok=experts)
    return Qwen3MoeForCausalLM(config).eval()


def _calls(model: torch.nn.Module, monkeypatch) -> dict[str, int]:
    """Segment-Gram calls, Triton launches (the fp64 segment SYRK, under the interpreter) and eigen calls
    (torch's eigensolver, one per group as on a GPU) of one batch's experts."""
    counts = {"segment_gram": 0, "launches": 0, "eigen": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return counted

    with monkeypatch.context() as patch:
        patch.setattr(capture, "segment_gram", counting("segment_gram", capture.segment_gram))
        patch.setattr(segment_syrk64, "launch", counting("launches", segment_syrk64.launch))
        patch.setattr(capture, "core_spectra", counting("eigen", capture.core_spectra))
        patch.setattr(capture, "gram_spectra", counting("eigen", capture.gram_spectra))
        engine = SpectralEngine(model, "experts", precision="fp64",
                                force={"segment_gram": "triton", "core": "torch", "gram": "torch"})
        scores = engine.score(*padded_batch(random_sequences([5, 6, 8], VOCAB, seed=6)))
    assert all(torch.isfinite(m).all() for m in scores.metrics.values())  # every expert reached, on the core path
    return counts


def test_gram_eigen_and_kernel_calls_do_not_grow_with_the_experts(monkeypatch):
    stacked = {E: _calls(_one_layer_moe(E), monkeypatch) for E in (4, 16, 64)}
    assert stacked[4] == stacked[16] == stacked[64]
    # up: X X^T, gate's and up's D D^T; down: its X X^T and D D^T. One eigen call per input.
    assert stacked[4]["segment_gram"] == 5 and stacked[4]["eigen"] == 2 and stacked[4]["launches"] >= 5
    _per_expert(monkeypatch)
    alone = {E: _calls(_one_layer_moe(E), monkeypatch) for E in (4, 16)}
    assert alone[16]["segment_gram"] == 4 * alone[4]["segment_gram"] == 16 * stacked[4]["segment_gram"]
    assert alone[16]["eigen"] == 16 * stacked[4]["eigen"] and alone[16]["launches"] == 16 * stacked[4]["launches"]


@pytest.mark.parametrize("family", list(MOE_KINDS))
def test_one_grouped_gemm_gives_the_rows_of_one_gemm_per_expert(family, monkeypatch):
    """The captured forward's grouped GEMM (torch's grouped_mm, one call per projection) against one GEMM
    per expert (fp64, older GPUs, autocast): every row the same, bit for bit (gpt-oss: transposed, biases)."""
    from gradspec.layers import experts

    model = tiny_model(family, vocab=VOCAB)
    seqs = random_sequences([5, 23, 70], VOCAB, seed=7)
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(experts._Grouped, "__call__", lambda self, *a, call=experts._Grouped.__call__:
                      calls.append(1) or call(self, *a))
        grouped = SpectralEngine(model, "all").score(*padded_batch(seqs))
    assert len(calls) == 2 * 2  # up and down, 2 layers
    monkeypatch.setattr(experts._Grouped, "runs", staticmethod(lambda X: False))
    loop = SpectralEngine(model, "all").score(*padded_batch(seqs))
    for name in loop.metrics:
        torch.testing.assert_close(grouped.metrics[name], loop.metrics[name], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(grouped.loss, loop.loss, rtol=0, atol=0)


@pytest.mark.parametrize("modules", ["model.layers.0.mlp.experts.3.*", "*.experts.*.up_proj",
                                     "*.experts.*.down_proj,*.experts.1.gate_proj"],
                         ids=["one expert", "one role", "roles differing by expert"])
def test_a_selection_of_some_experts_parts_stacks_to_the_same_rows(modules, monkeypatch):
    """Experts scoring different roles are stacked apart (a group per set of roles); unselected parts
    are neither scored nor stacked."""
    model = tiny_model("qwen3_moe", vocab=VOCAB)
    seqs = random_sequences([5, 23, 70, 41], VOCAB, seed=4)
    stacked = SpectralEngine(model, modules).score(*padded_batch(seqs))
    _per_expert(monkeypatch)
    alone = SpectralEngine(model, modules).score(*padded_batch(seqs))
    assert stacked.metrics.keys() == alone.metrics.keys()
    for name in alone.metrics:
        torch.testing.assert_close(stacked.metrics[name], alone.metrics[name], rtol=0, atol=0, equal_nan=True)
    assert stacked.flags == alone.flags
