import math

import pytest
import torch
from conftest import tiny_model

from gradspec.data.templates import IGNORE_INDEX
from gradspec.training.wit import WITCollator, WITLoss, encode_labels, wit_loss

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Translate 'chat'", "input": "from French", "output": "Cat."},
    {"instruction": "Say something long.", "output": "Something long " * 6},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
    {"instruction": "Count to three.", "output": "One, two, three."},
    {"instruction": "A colour?", "output": "Red."},
    {"instruction": "Why is the sky blue?", "output": "Rayleigh scattering of sunlight."},
]


def test_wit_equals_a_hand_computation():
    torch.manual_seed(0)
    V = 7
    input_ids = torch.tensor([[1, 3, 4, 5, 6, 0], [2, 5, 3, 1, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    response = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 0, 0]]).bool()
    logits = torch.randn(2, 6, V)
    logp = torch.log_softmax(logits, -1)
    for lp, lr in [(0.0, 1.0), (0.3, 0.8), (1.0, 1.0), (0.5, 0.0)]:
        total, count = 0.0, 0
        for i in range(2):
            for t in range(1, int(attention[i].sum())):  # token t is predicted at position t - 1
                is_response = bool(response[i, t])
                w = lr if is_response else lp
                total += w * float(logp[i, t - 1, input_ids[i, t]])
                count += (lr != 0) if is_response else (lp != 0)
        labels = encode_labels(input_ids, response, attention, lp, lr)
        assert float(wit_loss(logits, labels, lp, lr)) == pytest.approx(-total / count, rel=1e-6)
        # what Trainer counts as num_items_in_batch is WIT's denominator, lr = 0 included
        assert int((labels[:, 1:] != IGNORE_INDEX).sum()) == count
        assert float(wit_loss(logits, labels, lp, lr, num_items=count)) == pytest.approx(-total / count, rel=1e-6)
    loss = WITLoss(0.3, 0.8)
    assert float(loss.model_loss(logits, labels, V, ignore_index=-100)) == float(wit_loss(logits, labels, 0.3, 0.8))
    for unhonoured in ({"shift_labels": labels[:, 1:]}, {"ignore_index": 0}):  # refused, never ignored
        with pytest.raises(ValueError, match="cannot honour"):
            loss.model_loss(logits, labels, V, **unhonoured)


def test_wit_at_0_1_is_the_standard_completion_loss(tokenizer):
    model = tiny_model("llama")
    batch = WITCollator(tokenizer, prompt_weight=0.0)(ROWS[:4])
    standard = batch["labels"].clone()
    assert (standard >= IGNORE_INDEX).all()  # no prompt token is encoded at lp = 0
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=standard)
    mine = WITLoss(0.0, 1.0)(out, batch["labels"])
    assert float(mine.detach()) == pytest.approx(float(out.loss.detach()), rel=1e-6)


def _train_one_step(model_dir, tokenizer, loss, micro_batch, accumulation, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"run{micro_batch}"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
        lr_scheduler_type="constant", remove_unused_columns=False, report_to=[], save_strategy="no",
        use_cpu=True, seed=3, logging_strategy="no",
    )
    collator = WITCollator(tokenizer, prompt_weight=loss.prompt_weight)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS), data_collator=collator,
                      compute_loss_func=loss)
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("weights", [(0.0, 1.0), (0.4, 0.9)])
def test_trainer_step_does_not_depend_on_the_accumulation_split(weights, tiny_model_dir, tokenizer, tmp_path):
    """One SGD step on 8 rows: one batch of 8, or 8 micro-batches of 1 accumulated, must move the
    weights identically, because WIT's denominator is the global batch's token count."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    loss = WITLoss(*weights)
    whole = _train_one_step(tiny_model_dir, tokenizer, loss, 8, 1, tmp_path)
    split = _train_one_step(tiny_model_dir, tokenizer, loss, 1, 8, tmp_path)
    moved = 0.0
    for name, w in whole.items():
        torch.testing.assert_close(split[name], w, rtol=1e-5, atol=1e-6)
        moved = max(moved, float((w - initial[name]).abs().max()))
    assert moved > 1e-4  # the step did change the weights


def test_collator_reads_chat_rows_and_encodes_prompts(tokenizer):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    batch = WITCollator(tokenizer, prompt_weight=0.5, template="chat")([chat, ROWS[0]])
    labels, ids = batch["labels"], batch["input_ids"]
    prompt = labels <= -101
    assert prompt.any() and (labels[labels >= 0] == ids[labels >= 0]).all()
    assert (-labels[prompt] - 101 == ids[prompt]).all()
    assert (labels[batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert not math.isnan(float(wit_loss(torch.zeros(*ids.shape, 49152), labels, 0.5, 1.0)))


def test_sft_trainer_takes_the_wit_loss(tiny_model_dir, tokenizer, tmp_path):
    """TRL's SFTTrainer with WITCollator and WITLoss: same step as the plain Trainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    loss = WITLoss(0.4, 0.9)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, gradient_accumulation_steps=4,
        max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", remove_unused_columns=False,
        report_to=[], save_strategy="no", use_cpu=True, seed=3, logging_strategy="no",
        dataset_kwargs={"skip_prepare_dataset": True}, bf16=False,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer,
                         data_collator=WITCollator(tokenizer, prompt_weight=0.4), compute_loss_func=loss)
    trainer.train()
    want = _train_one_step(tiny_model_dir, tokenizer, loss, 8, 1, tmp_path)
    for name, w in model.state_dict().items():
        torch.testing.assert_close(w, want[name], rtol=1e-5, atol=1e-6)


def test_a_row_whose_spans_cannot_be_located_trains_on_nothing(tokenizer):
    """Not on its prompt alone either, whatever the prompt weight."""
    rows = [ROWS[0], {"instruction": "Say nothing.", "output": ""}]
    labels = WITCollator(tokenizer, prompt_weight=0.5)(rows)["labels"]
    assert (labels[0] != IGNORE_INDEX).any() and (labels[1] == IGNORE_INDEX).all()


def test_the_losses_never_read_the_device():
    """On the meta device any read of a device value (nonzero, .item(), a host copy) raises: WIT's loss and
    the monitor's per-sample losses run there whole, so a training step never waits for the GPU."""
    from gradspec.training.monitor_loss import sample_losses

    logits = torch.randn(3, 6, 11, device="meta", requires_grad=True)
    labels = torch.zeros(3, 6, dtype=torch.long, device="meta")
    wit_loss(logits, labels, 0.5, 1.0).backward()
    assert logits.grad.device.type == "meta"
    owner = torch.arange(3, device="meta")[:, None].expand(3, 6)
    assert sample_losses(logits.detach(), labels, 0.5, 1.0, owner, torch.ones(3, device="meta")).shape == (3,)


def test_the_monitor_s_losses_a_row_at_a_time_equal_the_whole_batch_s(monkeypatch):
    """The per-sample losses in chunks of rows (no fp32 copy of all the logits) equal one chunk's, and the
    weighted mean of each sample's own targets."""
    from gradspec.training import monitor_loss as monitor

    torch.manual_seed(0)
    logits = torch.randn(4, 7, 13, dtype=torch.bfloat16)
    labels = encode_labels(torch.randint(0, 13, (4, 7)), torch.rand(4, 7) > 0.4, torch.ones(4, 7, dtype=torch.long),
                           0.3, 1.0)
    owner = torch.arange(4)[:, None].expand(4, 7)
    tokens = monitor.loss_tokens(labels, 0.3, 1.0)
    whole = monitor.sample_losses(logits, labels, 0.3, 1.0, owner, tokens)
    monkeypatch.setattr(monitor, "LOSS_CHUNK_BYTES", 1)  # a row at a time
    torch.testing.assert_close(monitor.sample_losses(logits, labels, 0.3, 1.0, owner, tokens), whole, rtol=0, atol=0)
    for i in range(4):
        want = wit_loss(logits[i : i + 1], labels[i : i + 1], 0.3, 1.0) if tokens[i] else torch.tensor(float("nan"))
        torch.testing.assert_close(whole[i].float(), want, rtol=1e-6, atol=0, equal_nan=True)
