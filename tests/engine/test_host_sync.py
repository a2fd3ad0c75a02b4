"""The hooks never wait for the device: every split and token range comes from the lengths on the
host, once per batch. Tested on the meta device, where reading any device value (``.item()``,
``bool()``, ``.tolist()``, a copy to the host) raises: the hooks run there whole."""

import pytest
import torch
import transformers.masking_utils
from conftest import tiny_model

from gradspec.engine.capture import BatchCapture, LowRankSketch
from gradspec.layers.hooks import BatchLayout, attached
from gradspec.layers.targets import select_targets
from gradspec.linalg.host_copies import HostCopies
from gradspec.linalg.lowrank import LOWRANK_METRICS
from gradspec.linalg.metrics import METRICS
from gradspec.linalg.policy import Policy


@pytest.mark.parametrize("method", ["exact", "lowrank"])
def test_the_hooks_run_without_reading_the_device(monkeypatch, method):
    # transformers' own mask code reads position ids on the host; not ours to test
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda *a, **k: None)
    for solver in ("svd", "svdvals", "eigh", "eigvalsh", "cholesky"):  # on a GPU each reads its status back
        monkeypatch.setattr(torch.linalg, solver, lambda *a, solver=solver, **k: pytest.fail(f"{solver} in a hook"))
    model = tiny_model("llama", vocab=500).to("meta").requires_grad_(False)
    targets = select_targets(model, "all")
    lengths = torch.tensor([5, 40, 90])  # k/v's smaller side is 32: both the core and the materialised path
    sketch, names = (None, METRICS) if method == "exact" else (LowRankSketch(4, 1, 0), LOWRANK_METRICS)
    policy = Policy(force={"segment_gram": "torch", "segment_tdot": "torch"})  # the device paths
    capture = BatchCapture(targets, BatchLayout(lengths, "meta"), policy, sketch, names)
    ids = torch.zeros(3, 90, dtype=torch.long, device="meta")
    with attached(model, [capture]):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    if method == "exact":
        assert capture.core and capture.materialised
        assert all(group.B.device.type == "meta" for group in capture.core.values())
    else:
        assert len(capture.sketched) == sum(len(t.parts) for t in targets)


def test_host_copies_leave_host_tensors_be():
    copies = HostCopies(pinned=lambda t: pytest.fail("nothing to pin for a host tensor"))
    t = torch.arange(6.0)
    assert copies(t) is t
    copies.wait()


@pytest.mark.parametrize("token_stats", [False, True])
def test_a_pass_given_its_batch_on_the_host_never_reads_the_device(monkeypatch, token_stats):
    """The engine's whole pass (the batch's move to the model, the loss and its positions, the
    backward, the hooks, the copies queued for the host) on the meta device, where any read of a
    device value raises: given the batch on the host, as score gives it, nothing waits for the device."""
    from gradspec.data.templates import IGNORE_INDEX
    from gradspec.engine.loss import _HEAD_SHORTCUT
    from gradspec.engine.spectral_engine import SpectralEngine

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda *a, **k: None)
    # transformers reads the padding mask to choose between sdpa's causal flag and a mask: its read, not ours
    monkeypatch.setattr(transformers.masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    model = tiny_model("llama", vocab=500).to("meta")
    _HEAD_SHORTCUT[model] = True  # checked once per model, on its first batch: a read, by design
    engine = SpectralEngine(model, "all", token_stats=token_stats,
                            force={"segment_gram": "torch", "segment_tdot": "torch"})
    lengths = torch.tensor([5, 40, 90])
    mask = (torch.arange(90)[None] < lengths[:, None]).long()
    ids = torch.randint(3, 500, (3, 90)) * mask
    labels = torch.where(mask.bool() & (torch.arange(90)[None] >= 2), ids, IGNORE_INDEX)
    captures, passed = engine._forward_backward(ids, mask, labels)
    assert passed.loss.device.type == "meta" and passed.count.tolist() == [3, 38, 88]  # counted on the host
    assert all(t.device.type == "meta" for t in passed.stats.values()) and len(passed.stats) == 3 * token_stats
    core = captures[0].core
    assert core and all(group.B.device.type == "meta" for group in core.values())


def test_host_values_reach_the_device_through_to_device(monkeypatch):
    """A blocking copy from pageable host memory waits for the whole stream: the masks and owners the
    hooks build from host lengths go through to_device (pinned, non-blocking), which the meta device
    cannot tell apart from a plain .to()."""
    from gradspec.layers import hooks

    sent = []
    real = hooks.to_device
    monkeypatch.setattr(hooks, "to_device", lambda t, device: sent.append(t.device.type) or real(t, device))
    layout = hooks.BatchLayout(torch.tensor([3, 5]), "meta")
    layout.mask_on(torch.device("meta"))
    packed = hooks.PackedLayout([(0, 0, 3), (0, 3, 2)], (1, 5), "meta")
    packed.owner, packed.token_owner(torch.device("meta"))
    assert sent == ["cpu"] * 3


def test_the_copies_events_let_their_waiter_sleep(monkeypatch):
    """A default CUDA event's synchronize spins a host core, the eigen stage's; a blocking one sleeps."""
    made = []

    class Event:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def record(self, stream):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    copies = HostCopies()
    copies.streams = {torch.device("cuda", 0): object()}
    copies.wait()
    assert made == [{"blocking": True}]
