"""Under autocast the hooks hold X as the layer multiplies it (autocast's dtype), not the fp32 input
that autograd let go: half the memory, and the gradient trained on."""

import torch
from conftest import padded_batch, random_sequences, tiny_model

from gradspec.engine.capture import BatchCapture
from gradspec.engine.loss import response_losses
from gradspec.layers.hooks import BatchLayout, attached
from gradspec.layers.targets import select_targets
from gradspec.linalg.metrics import metric_names

VOCAB = 300


class _Seen(BatchCapture):
    def on_part(self, part, captured) -> None:
        self.dtypes = {**getattr(self, "dtypes", {}), part.name: captured.X.dtype}
        super().on_part(part, captured)


def test_under_autocast_x_is_held_in_autocast_s_dtype_and_gives_the_gradient_trained_on():
    model = tiny_model("llama", vocab=VOCAB).train()  # fp32 weights
    ids, mask, labels = padded_batch(random_sequences([7, 12], VOCAB, seed=3))
    capture = _Seen(select_targets(model, "attn"), BatchLayout(mask.sum(1), "cpu"), "auto", None, metric_names())
    with attached(model, [capture]), torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = response_losses(model, ids, mask, labels)
        loss.sum().backward()
    assert set(capture.dtypes.values()) == {torch.bfloat16}
    capture.to_host()
    metrics, _ = capture.reduce(torch.ones(2, dtype=torch.bool), [set(), set()], keep_spectra=False)
    nuclear = metric_names().index("nuclear_norm")
    for i in range(2):  # each sample alone, under the same autocast: its weight gradient's spectrum
        model.zero_grad()
        n = int(mask[i].sum())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = response_losses(model, ids[i : i + 1, :n], mask[i : i + 1, :n], labels[i : i + 1, :n])
        loss.sum().backward()
        for name, value in metrics.items():
            want = torch.linalg.svdvals(model.get_submodule(name).weight.grad.double()).sum()
            assert abs(value[i, nuclear].item() - want.item()) <= 2e-2 * want.item(), name
