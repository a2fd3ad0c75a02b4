"""gradspec vs the full-SVD reference and vs the forward+backward floor, on SmolLM2-135M.

16 HumanEval samples, q/k/v/o of all 30 layers, this machine's CPU. Run with
``pytest benchmarks/bench_score.py -s``; ratios are printed at the end and are only
meaningful within one run (the machine is noisy).
"""

import pytest
import torch
from conftest import MEDIANS

from gradspec.batching import BATCH_TOKENS, Item, pad_batch, token_batches
from gradspec.data import humaneval_samples
from gradspec.engine import SpectralEngine, response_loss_per_sample
from gradspec.models import load_model
from gradspec.reference import reference_scores
from gradspec.templates import tokenize

N_SAMPLES = 16


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model()
    items = [Item(s, tokenize(s.messages, tok, "plain", 2048)) for s in humaneval_samples(N_SAMPLES)]
    batches = [pad_batch([i.tokens for i in b], tok.pad_token_id, "cpu") for b in token_batches(items, BATCH_TOKENS)]
    singles = [(torch.tensor(i.tokens.input_ids), torch.tensor(i.tokens.labels)) for i in items]
    return model, batches, singles


def test_floor_forward_backward(setup, record):
    """The same batches through a plain forward and input-gradient backward, no hooks."""
    model, batches, _ = setup
    model.requires_grad_(False)

    def run():
        for ids, mask, labels in batches:
            embeds = model.get_input_embeddings()(ids).requires_grad_(True)
            logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
            response_loss_per_sample(logits, labels)[0].sum().backward()

    record("floor", run, rounds=5)


def test_gradspec(setup, record):
    model, batches, _ = setup
    engine = SpectralEngine(model, "attn")
    record("gradspec", lambda: [engine.score(*b) for b in batches], rounds=5)


def test_gradspec_pipelined(setup, record):
    """submit(): each batch's eigen stage overlaps the next batch's forward and backward."""
    model, batches, _ = setup
    engine = SpectralEngine(model, "attn")
    record("pipelined", lambda: [f.result() for f in [engine.submit(*b) for b in batches]], rounds=5)


def test_reference(setup, record):
    model, _, singles = setup
    record("reference", lambda: [reference_scores(model, ids, labels, "attn") for ids, labels in singles], rounds=1)


def test_report_ratios():
    if not {"floor", "gradspec", "reference"} <= MEDIANS.keys():
        pytest.skip("run the whole file")
    print(f"\n{N_SAMPLES} samples: floor {MEDIANS['floor']:.2f} s, gradspec {MEDIANS['gradspec']:.2f} s, "
          f"reference {MEDIANS['reference']:.2f} s")
    print(f"gradspec / floor = {MEDIANS['gradspec'] / MEDIANS['floor']:.2f}x (target <= 1.3x)")
    print(f"reference / gradspec = {MEDIANS['reference'] / MEDIANS['gradspec']:.1f}x faster (target >= 5x)")
    if "pipelined" in MEDIANS:
        print(f"pipelined {MEDIANS['pipelined']:.2f} s: {MEDIANS['pipelined'] / MEDIANS['floor']:.2f}x the floor, "
              f"reference / pipelined = {MEDIANS['reference'] / MEDIANS['pipelined']:.1f}x")
