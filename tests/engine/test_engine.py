import math

import pytest
import torch
from conftest import assert_matches_reference, padded_batch, random_sequences, tiny_model

from gradspec.engine.reference import reference_scores
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg import extension
from gradspec.linalg.metrics import METRICS

VOCAB = 500
# Lengths below and above every model's smallest dimension (32 for k/v), so both the T x T
# core path and the materialised-Gram path are taken within one batch.
LENGTHS = [5, 17, 40, 90]


def test_on_the_cpu_submit_finishes_each_batch_before_the_next_pass():
    """The pass and the eigen stage would compete for the same cores: no worker thread on the CPU."""
    model = tiny_model("llama", vocab=VOCAB)
    before = _eigen_threads()
    engine = SpectralEngine(model, "attn")
    batch = padded_batch(random_sequences([8, 40], VOCAB))
    future = engine.submit(*batch)
    assert future.done() and _eigen_threads() == before
    want = engine.score(*batch)
    for name in want.metrics:
        torch.testing.assert_close(future.result().metrics[name], want.metrics[name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "phi3"])
def test_engine_matches_reference(kind):
    model = tiny_model(kind, vocab=VOCAB)
    seqs = random_sequences(LENGTHS, VOCAB)
    scores = SpectralEngine(model, "all").score(*padded_batch(seqs))
    assert_matches_reference(model, scores, seqs, "all")


def test_scores_do_not_depend_on_batch_mates():
    model = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences([12, 60, 33, 7], VOCAB, seed=1)
    engine = SpectralEngine(model, "all")
    together = engine.score(*padded_batch(seqs))
    for i, seq in enumerate(seqs):
        alone = engine.score(*padded_batch([seq]))
        for name in engine.part_names:
            torch.testing.assert_close(alone.metrics[name][0], together.metrics[name][i], rtol=1e-5, atol=0)


@pytest.mark.skipif(not extension.BUILT, reason="no _C")
def test_cpp_and_torch_backends_agree():
    model = tiny_model("qwen2", vocab=VOCAB)
    batch = padded_batch(random_sequences(LENGTHS, VOCAB))
    a = SpectralEngine(model, "all", backend="cpp").score(*batch)
    b = SpectralEngine(model, "all", backend="torch").score(*batch)
    for name in a.metrics:
        torch.testing.assert_close(a.metrics[name], b.metrics[name], rtol=1e-6, atol=1e-12)


def test_the_model_is_left_as_it_was_found():
    """Built and used inside a training script: modes, requires_grad flags and .grad buffers
    stay as they were (a mixed state included), and scoring works under no_grad too."""
    model = tiny_model("llama", vocab=VOCAB).train()
    model.model.layers[1].eval()  # a mixed state: one submodule in eval mode
    model.lm_head.requires_grad_(False)  # some parameters frozen, the rest trainable
    before_grad = torch.ones_like(model.model.norm.weight)
    model.model.norm.weight.grad = before_grad.clone()
    modes = {name: m.training for name, m in model.named_modules()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    engine = SpectralEngine(model, "attn")
    assert {name: m.training for name, m in model.named_modules()} == modes  # building changes nothing
    batch = padded_batch(random_sequences([9, 20], VOCAB))
    first = engine.score(*batch)
    with torch.no_grad():
        again = engine.score(*batch)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert torch.equal(model.model.norm.weight.grad, before_grad)
    assert all(p.grad is None for name, p in model.named_parameters() if name != "model.norm.weight")
    for name in first.metrics:  # eval mode inside: dropout-free, the same numbers each time
        torch.testing.assert_close(first.metrics[name], again.metrics[name], rtol=0, atol=0)


def test_nonfinite_loss_is_flagged_and_others_kept():
    model = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences([10, 14], VOCAB)
    marker = 7
    seqs[0][0][2] = marker
    row = model.get_input_embeddings().weight.data[marker]
    row[0] = float("nan")
    scores = SpectralEngine(model, "attn").score(*padded_batch(seqs))
    assert scores.status(0) == "nonfinite_loss"
    assert torch.isnan(scores.metrics["model.layers.0.self_attn.q_proj"][0]).all()
    assert scores.status(1) == "ok"
    assert torch.isfinite(scores.metrics["model.layers.0.self_attn.q_proj"][1]).all()


def test_sample_without_response_tokens_is_flagged():
    model = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences([10, 14], VOCAB)
    seqs[0][1][:] = -100
    scores = SpectralEngine(model, "attn", token_stats=True).score(*padded_batch(seqs))
    assert scores.status(0) == "no_response_tokens" and scores.status(1) == "ok"
    assert math.isnan(scores.loss[0]) and math.isfinite(scores.loss[1])  # no tokens: no loss, not a 0
    assert all(math.isnan(v[0]) and math.isfinite(v[1]) for v in scores.token_stats.values())


def test_spectra_kept_on_request():
    model = tiny_model("llama", vocab=VOCAB)
    seqs = random_sequences([6, 50], VOCAB)
    scores = SpectralEngine(model, "q", keep_spectra=True).score(*padded_batch(seqs))
    name = "model.layers.0.self_attn.q_proj"
    for i in range(2):
        sigma = torch.as_tensor(scores.spectra[name][i])
        assert sigma.sum().item() == pytest.approx(scores.metrics[name][i, METRICS.index("nuclear_norm")].item())


def test_right_padding_required():
    model = tiny_model("llama", vocab=VOCAB)
    ids, mask, labels = padded_batch(random_sequences([4, 8], VOCAB))
    with pytest.raises(ValueError, match="right-padded"):
        SpectralEngine(model).score(ids, mask.flip(1), labels)


@pytest.mark.parametrize("template", ["plain", "chat"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "phi3"])
def test_engine_matches_reference_on_real_text(kind, template, tokenizer):
    """Mixed-length HumanEval samples through both templates, on each tiny model layout."""
    from conftest import VOCAB as SMOL_VOCAB

    from gradspec.data.readers import humaneval_samples
    from gradspec.data.templates import tokenize

    model = tiny_model(kind, vocab=SMOL_VOCAB)
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    conversations = [short] + [s.messages for s in humaneval_samples(3)]
    seqs = []
    for messages in conversations:
        t = tokenize(messages, tokenizer, template, 2048)
        seqs.append((torch.tensor(t.input_ids), torch.tensor(t.labels)))
    scores = SpectralEngine(model, "all").score(*padded_batch(seqs, tokenizer.pad_token_id))
    assert_matches_reference(model, scores, seqs, "all")


def test_bfloat16_model_runs_with_fp64_reductions():
    """Low-precision models still get fp64 Grams and core problems; values near the fp32 ones."""
    model = tiny_model("llama", vocab=VOCAB)
    batch = padded_batch(random_sequences([9, 40], VOCAB))
    fp32 = SpectralEngine(model, "attn").score(*batch)
    bf16 = SpectralEngine(model.to(torch.bfloat16), "attn").score(*batch)
    assert [bf16.status(i) for i in range(2)] == ["ok", "ok"]
    for name in fp32.metrics:
        assert bf16.metrics[name].dtype == torch.float64
        torch.testing.assert_close(bf16.metrics[name], fp32.metrics[name], rtol=0.1, atol=1e-6)


# Worst relative differences measured against the reference of the same model (2026-12-01): bf16
# nuclear 5.7e-3, effective rank 4.9e-2; fp16 7.2e-4 and 7.5e-3. The reference's weight gradient is
# rounded to the model's dtype by autograd; gradspec's Grams are formed in fp64 from the bf16/fp16
# activations and output gradients as they are, so the two differ by that rounding.
LOW_PRECISION = {torch.bfloat16: (1e-2, 1e-1), torch.float16: (2e-3, 2e-2)}


@pytest.mark.parametrize("dtype", list(LOW_PRECISION), ids=["bf16", "fp16"])
def test_low_precision_models_against_the_reference_of_the_same_model(dtype):
    model = tiny_model("llama", vocab=VOCAB).to(dtype)
    seqs = random_sequences([9, 40, 70], VOCAB)
    scores = SpectralEngine(model, "all").score(*padded_batch(seqs))
    rtol, rank_rtol = LOW_PRECISION[dtype]
    for i, (ids, labels) in enumerate(seqs):
        _, ref, _ = reference_scores(model, ids, labels, "all")
        assert scores.status(i) == "ok"
        for name, values in ref.items():
            for k, metric in enumerate(METRICS):
                tol = rank_rtol if metric == "effective_rank" else rtol
                assert scores.metrics[name][i, k].item() == pytest.approx(values[metric], rel=tol), (name, metric)


def test_submit_overlaps_batches_and_equals_score():
    model = tiny_model("llama", vocab=VOCAB)
    engine = SpectralEngine(model, "all", overlap=True)  # the GPU's way, on the CPU
    batches = [padded_batch(random_sequences(lengths, VOCAB, seed=s)) for s, lengths in
               enumerate([[8, 40], [70, 12, 33], [5]])]
    futures = [engine.submit(*b) for b in batches]  # all in flight before any result is read
    for batch, future in zip(batches, futures, strict=True):
        want = engine.score(*batch)
        got = future.result()
        assert got.flags == want.flags
        for name in want.metrics:
            torch.testing.assert_close(got.metrics[name], want.metrics[name], rtol=1e-12, atol=0)


def _eigen_threads() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("gradspec-eigen")}


def test_close_waits_for_submitted_batches_and_leaves_no_thread():
    """The engine's own worker threads, told apart from other engines' (an earlier test's engine may
    still be letting its worker go when this one starts: counting all of them raced)."""
    model = tiny_model("llama", vocab=VOCAB)
    others = _eigen_threads()
    with SpectralEngine(model, "attn", overlap=True) as engine:
        future = engine.submit(*padded_batch(random_sequences([8, 40], VOCAB)))
        mine = _eigen_threads() - others
        assert len(mine) == 1
    assert future.done() and future.result().flags == [set(), set()]
    assert not any(t.is_alive() for t in mine)
    engine.submit(*padded_batch(random_sequences([9], VOCAB))).result()  # usable after close: a new worker
    again = _eigen_threads() - others - mine
    assert len(again) == 1
    engine.close()
    assert not any(t.is_alive() for t in again)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "phi3"])
def test_backward_stops_at_the_lowest_scored_module(kind):
    """Scoring the last layer alone: the backward never reaches layer 0 (nothing there needs a
    gradient), and the last layer's numbers are exactly those of a run that scores every layer."""
    model = tiny_model(kind, vocab=VOCAB)
    batch = padded_batch(random_sequences(LENGTHS, VOCAB))
    blocks = [m for name, m in model.named_modules() if name.endswith(("layers.0", "h.0"))]
    everything = SpectralEngine(model, "all").score(*batch)  # the head check's forwards run here, once
    reached = []
    hook = blocks[0].register_forward_hook(lambda module, args, out: reached.append(
        (out[0] if isinstance(out, tuple) else out).requires_grad))
    last = SpectralEngine(model, "*.1.*").score(*batch)
    SpectralEngine(model, "all").score(*batch)
    hook.remove()
    assert reached == [False, True]  # last layer alone: layer 0 outside the graph; all layers: inside
    assert last.metrics and all(".1." in name for name in last.metrics)
    for name, values in last.metrics.items():
        assert torch.equal(values, everything.metrics[name]), name
    assert torch.equal(last.loss, everything.loss)


def test_a_malformed_batch_is_refused_not_scored():
    """Labels one column short would shift every label by a position: refused with the shapes."""
    model = tiny_model("llama", vocab=VOCAB)
    ids, mask, labels = padded_batch(random_sequences([6, 4], VOCAB))
    engine = SpectralEngine(model, "q")
    for batch in ((ids, mask, labels[:, :-1]), (ids[:0], mask[:0], labels[:0]), (ids[0], mask[0], labels[0]),
                  (ids, mask[:1], labels)):
        with pytest.raises(ValueError, match=r"a batch is input_ids, attention_mask and labels as tensors of one "
                                             r"shape \(N, T\), N >= 1; got"):
            engine.score(*batch)
    with pytest.raises(ValueError, match=r"nothing to compute: spectra=False, and neither a task"):
        SpectralEngine(model, "q", spectra=False).score(ids, mask, labels)


def test_a_scale_on_low_precision_gradients_is_applied_in_fp32():
    """The monitor's N / n_i on bf16 output gradients: rounding the product to bf16 would move the
    spectra by ~2^-9; the capture multiplies in fp32."""
    from gradspec.engine.capture import BatchCapture
    from gradspec.layers.hooks import BatchLayout
    from gradspec.layers.registry import Part
    from gradspec.linalg.metrics import metric_names

    torch.manual_seed(0)
    X, D = torch.randn(2, 7, 16, dtype=torch.bfloat16), torch.randn(2, 7, 8, dtype=torch.bfloat16)
    scale = torch.tensor([3.1, 0.37], dtype=torch.float64)
    part = Part("q_proj", "q", 16, 8, "q_proj.weight", (slice(None),), False, (0, 8, 1))
    target = type("T", (), {"parts": (part,)})()
    got = {}
    for name, (d, s) in {"scaled": (D, scale), "by hand": (D.double() * scale.view(-1, 1, 1), None)}.items():
        batch = BatchLayout(torch.tensor([7, 5]), "cpu")
        capture = BatchCapture([target], batch, "auto", None, metric_names(), s)
        capture.on_part(part, batch.whole(X, d))
        capture.to_host()
        got[name] = capture.reduce(torch.ones(2, dtype=torch.bool), [set(), set()], False)[0]["q_proj"]
    torch.testing.assert_close(got["scaled"], got["by hand"], rtol=1e-6, atol=0)


def test_release_forgets_every_gram_the_capture_holds():
    """A capture released mid-backward (the monitor's, on a fault in a hook) holds no Gram afterwards, the
    inputs' X X^T shared by the core path included: nothing of the batch is kept on the device."""
    from gradspec.engine.capture import BatchCapture
    from gradspec.layers.hooks import BatchLayout
    from gradspec.layers.registry import Part
    from gradspec.linalg.metrics import metric_names

    X, D = torch.randn(2, 7, 16), torch.randn(2, 7, 8)
    part = Part("q_proj", "q", 16, 8, "q_proj.weight", (slice(None),), False, (0, 8, 1))
    batch = BatchLayout(torch.tensor([7, 5]), "cpu")
    capture = BatchCapture([type("T", (), {"parts": (part,)})()], batch, "auto", None, metric_names())
    capture.on_part(part, batch.whole(X, D))
    assert capture.x_grams and capture.core  # both samples shorter than the part's smaller side: the core path
    capture.release()
    assert not capture.x_grams and not capture.core and not capture.materialised
