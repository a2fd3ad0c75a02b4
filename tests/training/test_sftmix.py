import pandas as pd
import pytest
import torch
from conftest import tiny_model

from gradspec.training.sftmix import PairedBatchSampler, SFTMixTrainer, confidence_halves, mixup_loss, ntp_loss
from gradspec.training.wit import WITCollator

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},  # confident: the shorter response
    {"instruction": "Two plus two?", "output": "Four, because two and two make four."},
    {"instruction": "Capital of France?", "output": "Paris."},
    {"instruction": "Say hi.", "output": "Hi there, nice to meet you today."},
]


def test_mixup_at_lambda_1_is_the_confident_samples_ntp_loss(tokenizer):
    model = tiny_model("llama")
    batch = WITCollator(tokenizer)([ROWS[0], ROWS[2], ROWS[1], ROWS[3]])  # pairs (0, 1) and (2, 3)
    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    head = model.get_output_embeddings()
    labels = batch["labels"]
    got = mixup_loss(hidden, labels, head, torch.ones(2))
    want = ntp_loss(hidden[:2], labels[:2], head)  # both confident responses fit in their partners'
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    at_zero = mixup_loss(hidden, labels, head, torch.zeros(2))
    assert float(at_zero.detach()) != pytest.approx(float(want.detach()), rel=1e-3)


def _mixup_by_rows(hidden, labels, head, lam):
    """The Mixup term pair by pair, each pair's response positions read on the host: the reference."""
    pairs, mixed, y_conf, y_unconf, weights = len(labels) // 2, [], [], [], []
    positions = [torch.nonzero(row[1:] != -100).flatten() for row in labels]
    for j in range(pairs):
        n = min(len(positions[j]), len(positions[pairs + j]))
        pc, pu = positions[j][:n], positions[pairs + j][:n]
        mixed.append(lam[j] * hidden[j, pc] + (1 - lam[j]) * hidden[pairs + j, pu])
        y_conf.append(labels[j, pc + 1])
        y_unconf.append(labels[pairs + j, pu + 1])
        weights.append(lam[j].expand(n))
    logits, w = head(torch.cat(mixed)).double(), torch.cat(weights).double()
    nll = torch.nn.functional.cross_entropy
    return (w * nll(logits, torch.cat(y_conf), reduction="none")
            + (1 - w) * nll(logits, torch.cat(y_unconf), reduction="none")).mean()


def test_the_losses_equal_their_row_by_row_references():
    """Fixed shapes (no nonzero, no per-row indexing) give the losses of the row-by-row computation: a
    pair whose confident response is the longer, one whose responses differ most, one without a response."""
    torch.manual_seed(0)
    hidden = torch.randn(6, 9, 8, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False).double()
    labels = torch.randint(0, 11, (6, 9))
    for row, (start, stop) in enumerate([(2, 9), (5, 7), (1, 3), (3, 9), (9, 9), (4, 8)]):
        labels[row, :start], labels[row, stop:] = -100, -100
    lam = torch.tensor([0.3, 0.8, 0.5], dtype=torch.float64)
    got, want = mixup_loss(hidden, labels, head, lam), _mixup_by_rows(hidden, labels, head, lam)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)  # the loss in fp32 (next_token_nll)
    (g,), (w,) = torch.autograd.grad(got, hidden), torch.autograd.grad(want, hidden)
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    target = labels[:, 1:][labels[:, 1:] != -100]
    ntp = torch.nn.functional.cross_entropy(head(hidden[:, :-1][labels[:, 1:] != -100]), target)
    assert ntp_loss(hidden, labels, head).item() == pytest.approx(ntp.item(), rel=1e-6)
    empty = labels.clone()
    empty[:3] = -100
    assert mixup_loss(hidden, empty, head, lam).item() == 0.0


def test_the_losses_never_read_the_device():
    """On the meta device any read of a device value (nonzero, .item(), a length, a host copy) raises: the
    losses run there whole, and lam's distribution lives there (drawn there: no host copy), so a training step
    never waits for the GPU."""
    hidden = torch.randn(4, 7, 8, device="meta", requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False, device="meta")
    labels = torch.zeros(4, 7, dtype=torch.long, device="meta")
    trainer = object.__new__(SFTMixTrainer)
    trainer.alpha, trainer._beta = 0.5, None
    assert trainer.beta(hidden.device).concentration1.device.type == "meta"  # meta has no Dirichlet sampler
    lam = torch.full((2,), 0.5, device="meta")
    loss = ntp_loss(hidden, labels, head) + 0.2 * mixup_loss(hidden, labels, head, lam)
    loss.backward()
    assert hidden.grad.device.type == "meta"


def test_confidence_halves_split_at_the_median():
    dynamics = pd.DataFrame({"index": [0, 1, 2, 3, 4], "mean_perplexity": [3.0, 9.0, 1.5, 20.0, 5.0]})
    assert confidence_halves(dynamics) == ([0, 2], [1, 3, 4])
    unmeasured = pd.concat([dynamics, pd.DataFrame({"index": [5], "mean_perplexity": [float("nan")]})])
    assert confidence_halves(unmeasured) == ([0, 2], [1, 3, 4])  # no response tokens: in neither half


def test_confidence_halves_of_the_trained_rows_are_their_positions():
    """A reference file of the whole data, training on rows 2 to 4 of it (their positions 0 to 2):
    the halves split those rows alone and name positions in the training rows."""
    dynamics = pd.DataFrame({"index": [0, 1, 2, 3, 4, 5], "mean_perplexity": [1.0, 2.0, 9.0, 3.0, 5.0, 0.5]})
    assert confidence_halves(dynamics, [2, 3, 4]) == ([1], [0, 2])
    assert confidence_halves(dynamics, [4, 2]) == ([0], [1])  # training order, not index order


def test_paired_batches_are_balanced_and_cover_every_sample():
    confident, unconfident = [0, 2, 4, 6], [1, 3, 5, 7, 9, 11]
    sampler = PairedBatchSampler(confident, unconfident, pairs=2, seed=1)
    for _ in range(3):  # epochs
        batches = list(sampler)
        assert len(batches) == len(sampler) == 3
        for b in batches:
            assert len(b) == 4 and set(b[:2]) <= set(confident) and set(b[2:]) <= set(unconfident)
        seen = {i for b in batches for i in b}
        assert seen == set(confident) | set(unconfident)
    again = PairedBatchSampler(confident, unconfident, pairs=2, seed=1)
    assert list(again) == list(PairedBatchSampler(confident, unconfident, pairs=2, seed=1))


def test_sftmix_trainer_trains(tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=2,
                             learning_rate=1e-2, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_steps=1)
    trainer = SFTMixTrainer(model=model, args=args, train_dataset=ROWS, data_collator=WITCollator(tokenizer),
                            confident=[0, 2], unconfident=[1, 3])
    result = trainer.train()
    assert result.global_step == 4 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)


def test_the_loss_goes_through_the_wrapper_trainer_passes(tiny_model_dir, tokenizer, tmp_path):
    """Under DDP Trainer passes the wrapper: its forward must run (its gradient sync), and the loss is the
    one of the model's last hidden states after the final norm (a one-process gloo group here)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                             remove_unused_columns=False, use_cpu=True)
    trainer = SFTMixTrainer(model=model, args=args, train_dataset=ROWS, data_collator=WITCollator(tokenizer),
                            confident=[0, 2], unconfident=[1, 3], mu=0.0)  # mu 0: no random Mixup weight
    batch = WITCollator(tokenizer)([ROWS[0], ROWS[2], ROWS[1], ROWS[3]])
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    want = ntp_loss(hidden, batch["labels"], model.get_output_embeddings())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        got = trainer.compute_loss(wrapped, batch)
        got.backward()
    finally:
        dist.destroy_process_group()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
