"""Exact per-sample gradient spectra for a padded batch, from one forward and one backward.

Parameters are frozen, so the backward computes input gradients only: no weight-gradient
GEMMs and no ``.grad`` buffers. Hooks capture each scored module's input X (T x d_in) and
output gradient D (T x d_out) per sample; the sample's weight gradient is G = D^T X. Its
singular values come from the smallest of the three sizes: the T x T core problem from
X X^T and D D^T when T is smallest, else the Gram of the materialised G.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from gradspec.engine.capture import BatchCapture, LowRankSketch
from gradspec.engine.loss import check_head_shortcut, response_losses
from gradspec.kernels import token_mask
from gradspec.layers.targets import Part, Target, select_targets
from gradspec.linalg import stages
from gradspec.linalg.lowrank import LOWRANK_METRICS
from gradspec.linalg.metrics import METRICS
from gradspec.linalg.policy import Policy


@dataclass
class BatchScores:
    """Per-sample results of one batch; metrics[part] is (N, n) in the engine's metric_names order."""

    loss: torch.Tensor
    num_response_tokens: torch.Tensor
    flags: list[set[str]]
    metrics: dict[str, torch.Tensor]
    spectra: dict[str, list[np.ndarray]] = field(default_factory=dict)
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)  # see response_losses

    def status(self, i: int) -> str:
        return ";".join(sorted(self.flags[i])) or "ok"


class SpectralEngine:
    """Scores tokenized batches for one model; reusable across batches and inside training loops.

    The model is borrowed, not taken: for each batch it is put in eval mode with frozen
    parameters, and its modes and requires_grad flags are restored after the backward."""

    def __init__(
        self, model: nn.Module, modules: str | list[str] = "attn",
        backend: str = "auto", keep_spectra: bool = False,
        method: str = "exact", rank: int = 64, power_iters: int = 2, seed: int = 0, token_stats: bool = False,
        precision: str = "fp64", force: dict[str, str] | None = None,
    ) -> None:
        """method="lowrank" approximates the top `rank` singular values (see gradspec.linalg.lowrank);
        token_stats adds each sample's mean predictive entropy and token accuracy; precision and
        force (a path per stage) are gradspec.linalg.policy's, and ``policy.describe()`` says what ran."""
        if method not in ("exact", "lowrank"):
            raise ValueError(f"method must be 'exact' or 'lowrank', got {method!r}")
        self.model = model
        self.targets: list[Target] = select_targets(model, modules)
        self.parts: list[Part] = [p for t in self.targets for p in t.parts]
        self.policy = Policy(precision, backend, dict(force or {}))
        self.keep_spectra = keep_spectra
        self.sketch = LowRankSketch(rank, power_iters, seed) if method == "lowrank" else None
        self.metric_names = METRICS if self.sketch is None else LOWRANK_METRICS
        self.token_stats = token_stats
        self._eigen_worker: ThreadPoolExecutor | None = None

    @property
    def part_names(self) -> list[str]:
        return [p.name for p in self.parts]

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> BatchScores:
        """Right-padded batch; labels are input_ids with IGNORE_INDEX outside the response."""
        return self._finish(*self._forward_backward(input_ids, attention_mask, labels))

    def submit(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> Future[BatchScores]:
        """``score`` with its eigen stage on a worker thread: the forward, the backward and the
        Grams run now; the caller can start the next batch (on the GPU, or other cores) while the
        CPU solves this one's eigenproblems. A batch whose eigen stage is still to be measured for
        its size finishes here instead: its timings must not share the device with the next batch."""
        if self._eigen_worker is None:
            self._eigen_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradspec-eigen")
        work = self._forward_backward(input_ids, attention_mask, labels)
        if not work[0].measures:
            return self._eigen_worker.submit(self._finish_beside_measurements, *work)
        done: Future[BatchScores] = Future()
        try:
            done.set_result(self._finish(*work))
        except Exception as error:  # raised from result(), as from the worker
            done.set_exception(error)
        return done

    def _finish_beside_measurements(self, *work) -> BatchScores:
        """On the worker: a measurement on the caller's thread (a new size's Gram path) waits for this."""
        with stages.DISPATCH.lock:
            return self._finish(*work)

    def _forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        # The batch's one host synchronisation: its lengths, from which every split is decided.
        mask = attention_mask.cpu().bool()
        lengths = mask.sum(1)
        if not torch.equal(mask, token_mask(lengths, mask.shape[1], "cpu")):
            raise ValueError("the batch must be right-padded (attention_mask a prefix of ones)")
        capture = BatchCapture(self.targets, lengths, self.policy, self.sketch, self.metric_names,
                          device=input_ids.device)
        with borrowed(self.model), torch.enable_grad():
            check_head_shortcut(self.model, input_ids, attention_mask, labels)
            with capture.hooks(self.model):
                loss, count, stats = response_losses(self.model, input_ids, attention_mask, labels, self.token_stats)
                finite = torch.isfinite(loss) & (count > 0)
                if finite.any():
                    loss[finite].sum().backward()
        capture.to_host()
        return capture, loss.detach().double().cpu(), count.cpu(), finite.cpu(), stats

    def _finish(
        self, capture: BatchCapture, loss: torch.Tensor, count: torch.Tensor, finite: torch.Tensor,
        stats: dict[str, torch.Tensor],
    ) -> BatchScores:
        flags: list[set[str]] = [set() for _ in range(len(loss))]
        for i in torch.nonzero(~finite).flatten().tolist():
            flags[i].add("no_response_tokens" if count[i] == 0 else "nonfinite_loss")
        try:
            metrics, spectra = capture.reduce(finite, flags, self.keep_spectra)
        finally:
            capture.release()
        return BatchScores(loss, count, flags, metrics, spectra, stats)


@contextmanager
def borrowed(model: nn.Module) -> Iterator[None]:
    """The model in eval mode with frozen parameters (input-gradient backward only), then every
    module's mode and every parameter's requires_grad as they were: an engine built inside a
    training script must not stop its training."""
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    model.requires_grad_(False)
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)
