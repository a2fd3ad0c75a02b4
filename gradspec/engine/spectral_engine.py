"""Exact per-sample gradient spectra for a padded batch, from one forward and one backward.

Parameters are frozen, so the backward computes input gradients only: no weight-gradient
GEMMs and no ``.grad`` buffers. Hooks capture each scored module's input X (T x d_in) and
output gradient D (T x d_out) per sample; the sample's weight gradient is G = D^T X. Its
singular values come from the smallest of the three sizes: the T x T core problem from
X X^T and D D^T when T is smallest, else the Gram of the materialised G.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from gradspec.alignment.capture import AlignmentCapture
from gradspec.alignment.preconditioner import Preconditioner
from gradspec.alignment.projection import KroneckerProjection, ProjectionCapture
from gradspec.alignment.task import TaskGradients, collect_task
from gradspec.choices import DEFAULT_AGGREGATES, METHODS
from gradspec.data.models import input_device
from gradspec.engine.capture import BatchCapture, LowRankSketch
from gradspec.engine.loss import check_head_shortcut, response_losses
from gradspec.layers.experts import ExpertsTarget
from gradspec.layers.hooks import BatchLayout, Capture, attached, token_mask
from gradspec.layers.lora import unwrap
from gradspec.layers.registry import Part, Target
from gradspec.layers.targets import select_targets
from gradspec.linalg import extension, stages
from gradspec.linalg.host_copies import HostCopies, to_device
from gradspec.linalg.lowrank import lowrank_metric_names
from gradspec.linalg.metrics import metric_names
from gradspec.linalg.policy import Policy


@dataclass
class BatchScores:
    """Per-sample results of one batch; metrics[part] is (N, n) in the engine's metric_names order
    (NaN where a sample did not reach a routed part).

    Made by SpectralEngine.score for a batch of N samples; every tensor is on the host.

    Args:
        loss: (N,) fp64, each sample's mean loss over its response tokens; meaningful where
            ``scored`` only (NaN for a sample without response tokens, NaN or inf where not finite).
        num_response_tokens: (N,) int64, the labelled (response) tokens of each sample.
        flags: Per sample, what went wrong for it (e.g. "no_response_tokens", "nonfinite_loss",
            "nonfinite_gradient", "zero_gradient"); empty when nothing did.
        metrics: Part name -> (N, len(engine.metric_names)) fp64: the spectral metrics, then the
            "align_<aggregate>" cosines; NaN where a sample has no value.
        spectra: Part name -> per sample its nonzero singular values, descending (an empty array for
            a sample not scored); filled only with ``keep_spectra``.
        token_stats: "mean_entropy", "token_accuracy", "mean_token_prob" -> (N,) fp64 means over
            the response tokens; filled only with ``token_stats``.
        alignment: "align_<aggregate>" -> (N,) fp64 cosines over the whole scored model; filled
            only after ``set_task``.
        attribution: (N, m) fp64, each sample's (preconditioned) gradient's inner product with each
            task example's over the whole scored model, NaN where either has none; only after
            ``set_task(..., attribution=True)``.
        projection: (N, dims) fp32 projected gradients, parts in order (gradspec.alignment.projection);
            NaN rows for samples not scored; None without ``project``.
        routed_tokens: "<experts module>.<e>" -> (N,) int64 tokens each sample routed to expert e,
            for every expert with a scored part.
        scored: (N,) bool, the samples with response tokens and a finite loss: the ones whose
            gradients were scored.
    """

    loss: torch.Tensor
    num_response_tokens: torch.Tensor
    flags: list[set[str]]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    spectra: dict[str, list[np.ndarray]] = field(default_factory=dict)
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)  # see response_losses
    alignment: dict[str, torch.Tensor] = field(default_factory=dict)  # whole-model cosines, (N,) each
    attribution: torch.Tensor | None = None  # (N, m) fp64: inner products with each task example's gradient
    projection: torch.Tensor | None = None  # (N, dims) fp32: gradspec.alignment.projection's, parts in order
    routed_tokens: dict[str, torch.Tensor] = field(default_factory=dict)  # "<experts>.<e>" -> (N,) tokens routed
    scored: torch.Tensor | None = None  # (N,) bool: which samples had a loss to differentiate

    def status(self, i: int) -> str:
        """A sample's flags as a score file's status column writes them.

        Args:
            i: The sample's row in the batch.

        Returns:
            Its flags, sorted and joined by ";", or "ok" when it has none.
        """
        return ";".join(sorted(self.flags[i])) or "ok"


class SpectralEngine:
    """Scores tokenized batches for one model; reusable across batches and inside training loops.

    The model is borrowed, not taken: for each batch it is put in eval mode with frozen
    parameters, and its modes and requires_grad flags are restored after the backward.

    Args:
        model: The causal LM to score with (a PEFT model: the model it adapts, LoRA parts included).
        modules: What to score: a preset (attn, mlp, experts, router, all, lora), role names
            ("q,k") or globs of part names ("*.3.*q_proj"), comma-separated or as a list.
        backend: "cpp" or "torch" forces that path wherever a linear-algebra stage has it; "auto"
            measures or prefers (gradspec.linalg.policy).
        keep_spectra: Also keep each sample's singular values (BatchScores.spectra).
        method: "exact", or "lowrank" to approximate the top `rank` singular values
            (gradspec.linalg.lowrank; adds the column topk_energy).
        rank: Singular values kept per part by the low-rank method.
        power_iters: The low-rank method's power iterations.
        seed: Seeds the low-rank sketches and the projection.
        token_stats: Also each sample's mean predictive entropy, token accuracy and mean target-token
            probability (BatchScores.token_stats).
        precision: "fp64" (default) or "fp32": what the Grams and sketch products accumulate in;
            eigenproblems are solved in fp64 either way.
        force: {stage: path} for single stages (gradspec.linalg.policy.STAGES); ``policy.describe()``
            says what ran.
        spectra: False leaves the spectral metrics out (for alignment or projection alone: see
            set_task).
        project: k > 0 adds each sample's gradient under a seeded k x k Kronecker projection per
            part (a store's rows, BatchScores.projection); 0: none.
        overlap: Whether submit runs each batch's eigen stage on a worker thread beside the next
            pass. None: where the pass runs on a GPU; on the CPU the two compete for the same cores,
            and finishing each batch first measured 8% faster on 2 cores (benchmarks/RESULTS.md).
    """

    def __init__(
        self, model: nn.Module, modules: str | list[str] = "attn",
        backend: str = "auto", keep_spectra: bool = False,
        method: str = "exact", rank: int = 64, power_iters: int = 2, seed: int = 0, token_stats: bool = False,
        precision: str = "fp64", force: dict[str, str] | None = None, spectra: bool = True, project: int = 0,
        overlap: bool | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be 'exact' or 'lowrank', got {method!r}")
        self.model = unwrap(model)  # a PEFT model: the model it adapts (the same modules)
        self.targets: list[Target] = select_targets(model, modules)
        self.parts: list[Part] = [p for t in self.targets for p in t.parts]
        self.policy = Policy(precision, backend, dict(force or {}))
        self.keep_spectra = keep_spectra
        self.sketch = LowRankSketch(rank, power_iters, seed) if method == "lowrank" else None
        self.spectra = spectra
        self.token_stats = token_stats
        self.task: TaskGradients | None = None
        self.projection = KroneckerProjection(self.parts, project, project, seed) if project else None
        self._eigen_worker: ThreadPoolExecutor | None = None
        self.overlap = overlap
        self.lockstep = None  # under FSDP (gradspec.runs.fsdp.Lockstep): every pass runs on all ranks together
        # the metrics registered now (gradspec.linalg.metrics.register_metric): this engine's columns
        self._spectral_names = metric_names() if self.sketch is None else lowrank_metric_names()

    @property
    def spectral_names(self) -> tuple[str, ...]:
        """The spectral metrics' columns, in order (the metrics registered when the engine was
        built; none with spectra=False)."""
        return self._spectral_names if self.spectra else ()

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Each part's columns, in order: the spectral metrics, then the alignment cosines."""
        return self.spectral_names + (() if self.task is None else self.task.metric_names)

    def set_task(
        self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        aggregates: list[str] | str = DEFAULT_AGGREGATES, route: str = "auto",
        preconditioner: Preconditioner | None = None, attribution: bool = False,
        example_rows: tuple[list[int], int] | None = None, progress: bool = False,
    ) -> TaskGradients:
        """Compare every later batch's gradients with these task examples' (right-padded batches,
        as for score), under the model as it is now: call again to follow a training model. Adds the
        cosine columns "align_<aggregate>" per part and over the whole scored model.

        Args:
            batches: The task examples as (input_ids, attention_mask, labels) batches, as score
                takes them; example j is the j-th row over all batches. Examples without a usable
                gradient are left out with a warning.
            aggregates: One or more of "mean_gradient" (the cosine with the task's mean gradient),
                "mean" and "max" (of the cosines with each example's gradient), as a list or
                comma-separated. "max" keeps one direction per example instead of three per part.
            route: How each part's directions are held: "dense" (K d_out x d_in matrices), "cross"
                (the task's own inputs and output gradients), or "auto": the cheaper per part,
                within GRADSPEC_TASK_BYTES (default 8 GiB) of held directions.
            preconditioner: Applied before the gradients are compared (gradspec.alignment.preconditioner:
                K-FAC or EK-FAC on the task's side, Adam on each pool sample's); None: plain gradients.
            attribution: Also each pool sample's inner product with every task example's gradient
                (BatchScores.attribution): the per-(sample, example) influence scores.
            example_rows: (the task file's row of each example, its rows): the attribution laid out
                over the file's rows, NaN for those left out (default: over the examples given).
            progress: A progress bar for each pass over the task's examples (they can take minutes).

        Returns:
            The task's directions, also kept as ``self.task``.
        """
        self.task = collect_task(self.backward_pass, self.targets, batches, aggregates, self.policy.dtype, route,
                                 preconditioner=preconditioner, attribution=attribution, example_rows=example_rows,
                                 progress=progress)
        return self.task

    @property
    def part_names(self) -> list[str]:
        """The scored parts' names, in column order."""
        return [p.name for p in self.parts]

    @property
    def routed_names(self) -> list[str]:
        """"<experts module>.<e>" of every expert with a scored part: each row records its routed tokens."""
        return [f"{t.scored_as}.{e}" for t in self.targets if isinstance(t, ExpertsTarget) for e in t.experts_scored]

    def describe(self) -> dict:
        """How the scored targets were captured, where a kind says (experts: the implementation run).

        Returns:
            The targets' descriptions merged into one dict, as a score file's metadata records them.
        """
        out: dict = {}
        for t in self.targets:
            out.update(t.describe() or {})
        return out

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> BatchScores:
        """Right-padded batch; labels are input_ids with IGNORE_INDEX outside the response. Given on the
        host, the batch goes to the model's device without the host waiting for the device.

        Args:
            input_ids: (N, T) token ids, N >= 1.
            attention_mask: (N, T), each row a prefix of ones (right padding; left padding is refused).
            labels: (N, T) the input ids at the response's tokens, IGNORE_INDEX (-100) elsewhere.

        Returns:
            The batch's per-sample results, on the host.
        """
        return self._finish(*self._forward_backward(input_ids, attention_mask, labels))

    def submit(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> Future[BatchScores]:
        """``score`` with its eigen stage on a worker thread (where it overlaps: see overlap): the
        forward, the backward and the Grams run now; the caller can start the next batch on the GPU
        while the host solves this one's eigenproblems. A batch whose eigen stage is still to be
        measured for its size finishes here instead: its timings must not share the device with the
        next batch. Either way the result comes as a Future.

        Args:
            input_ids: (N, T) token ids, as for score.
            attention_mask: (N, T) right-padded mask, as for score.
            labels: (N, T) response labels, as for score.

        Returns:
            A Future of the batch's BatchScores; its result() raises what scoring raised.
        """
        work = self._forward_backward(input_ids, attention_mask, labels)
        captures = work[0]
        overlap = self.overlap if self.overlap is not None else captures[0].batch.device.type != "cpu"
        if overlap and not any(capture.measures for capture in captures):
            if self._eigen_worker is None:
                self._eigen_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradspec-eigen")
            return self._eigen_worker.submit(self._finish_beside_measurements, *work)
        done: Future[BatchScores] = Future()
        try:
            done.set_result(self._finish(*work))
        except Exception as error:  # raised from result(), as from the worker
            done.set_exception(error)
        return done

    def close(self) -> None:
        """Waits for submitted batches and stops the eigen worker thread; the engine can score on
        after (submit starts a new worker). Also on leaving ``with SpectralEngine(...) as engine``."""
        worker, self._eigen_worker = self._eigen_worker, None
        if worker is not None:
            worker.shutdown(wait=True)

    def __enter__(self) -> SpectralEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        worker = getattr(self, "_eigen_worker", None)
        if worker is not None:
            worker.shutdown(wait=False)

    def _finish_beside_measurements(self, *work) -> BatchScores:
        """On the worker: a measurement on the caller's thread (a new size's Gram path) waits for this."""
        with stages.DISPATCH.lock:
            return self._finish(*work)

    def backward_pass(self, captures: list[Capture], batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        """One forward and input-gradient backward of a right-padded batch with every target's hooks
        delivering to these captures -> (loss, count, finite, token stats), the per-sample values on the CPU.

        Args:
            captures: What receives each target's X and D (gradspec.layers.hooks.Capture).
            batch: (input_ids, attention_mask, labels), right-padded, as for score.

        Returns:
            (loss, count, finite, stats): (N,) fp64 mean response losses, (N,) response-token counts,
            (N,) bool which samples had a finite loss over at least one token, and the token stats
            (empty without ``token_stats``).
        """
        passed = self._pass(captures, batch)
        passed.copies.wait()
        return passed.loss, passed.count, passed.finite, passed.stats

    def _pass(self, captures: list[Capture], batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> _Passed:
        """backward_pass, its per-sample values queued for the host without waiting for them (_Passed.copies).
        With the labels on the host, nothing here waits for the device."""
        input_ids, attention_mask, labels = batch
        with borrowed(self.model), torch.enable_grad(), ExitStack() as hooked:
            # SciPy's BLAS at one thread for the whole pass, not once per host Gram (setting it costs
            # about 50 us: 0.06 s a pass of 600 Grams); restored as found after
            hooked.enter_context(extension.ONE_BLAS_THREAD())
            check_head_shortcut(self.model, input_ids, attention_mask, labels)
            hooked.enter_context(attached(self.model, captures))
            loss, count, stats = response_losses(self.model, input_ids, attention_mask, labels, self.token_stats)
            finite = torch.isfinite(loss) & (to_device(count, loss.device) > 0)
            # A sample whose loss is not finite gets a zero output gradient (its own rows only: they are
            # not scored); under FSDP the backward is collective and runs even where nothing is finite.
            if self.lockstep is not None or bool(count.any()):
                torch.where(finite, loss, 0.0).sum().backward()
        if self.lockstep is not None:
            self.lockstep.after_pass()
        for capture in captures:
            capture.to_host()
        copies = HostCopies()
        passed = _Passed(*(copies(t) for t in (loss.detach().double(), count, finite)),
                         {name: copies(t) for name, t in stats.items()}, copies)
        copies.queued()
        return passed

    def _forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        shapes = [tuple(getattr(t, "shape", ())) for t in (input_ids, attention_mask, labels)]
        if len(shapes[0]) != 2 or shapes.count(shapes[0]) != 3 or not shapes[0][0]:
            raise ValueError("a batch is input_ids, attention_mask and labels as tensors of one shape (N, T), N >= 1; "
                             f"got {', '.join(map(str, shapes))}")
        if not (self.spectra or self.task is not None or self.projection is not None):
            raise ValueError("nothing to compute: spectra=False, and neither a task (set_task) nor a projection "
                             "(project=k)")
        # Lengths and label positions are read on the host: a batch given there (as score gives it)
        # goes to the model's device without the host waiting for the device; one given on a GPU is
        # read back once here.
        mask, labels_host = attention_mask.cpu().bool(), labels.cpu()
        lengths = mask.sum(1)
        if not torch.equal(mask, token_mask(lengths, mask.shape[1], "cpu")):
            raise ValueError("the batch must be right-padded (attention_mask a prefix of ones)")
        if self.lockstep is not None:  # after the checks: a batch refused here has started no collective
            self.lockstep.before_pass()
        device = input_device(self.model) if input_ids.device.type == "cpu" else input_ids.device
        input_ids, attention_mask = to_device(input_ids, device), to_device(attention_mask, device)
        layout = BatchLayout(lengths, device)
        captures: list[Capture] = []  # in column order: the spectral metrics, then the cosines
        if self.spectra:
            captures.append(BatchCapture(self.targets, layout, self.policy, self.sketch, self.spectral_names,
                                         keep_spectra=self.keep_spectra))
        if self.task is not None:
            captures.append(AlignmentCapture(self.targets, layout, self.task, self.policy.dtype))
        if self.projection is not None:
            captures.append(ProjectionCapture(self.targets, layout, self.projection, self.policy.dtype))
        return captures, self._pass(captures, (input_ids, attention_mask, labels_host))

    def _finish(self, captures: list[Capture], passed: _Passed) -> BatchScores:
        """The eigen stage and the rows, once the pass's copies have landed (on the worker thread: it
        waits on their events, not on the device's later work)."""
        try:
            passed.copies.wait()
            for capture in captures:
                capture.wait_host()
            loss, count, finite = passed.loss.clone(), passed.count.clone(), passed.finite.clone()
            stats = {name: t.clone() for name, t in passed.stats.items()}
            flags: list[set[str]] = [set() for _ in range(len(loss))]
            for i in torch.nonzero(~finite).flatten().tolist():
                flags[i].add("no_response_tokens" if count[i] == 0 else "nonfinite_loss")
            loss[count == 0] = math.nan  # no token to average over: no loss, flagged (never a 0 that reads as learned)
            for values in stats.values():
                values[count == 0] = math.nan
            routed = captures[0].batch.routed_tokens if captures else {}
            zeros = torch.zeros(len(loss), dtype=torch.int64)
            scores = BatchScores(loss, count, flags, token_stats=stats, scored=finite,
                                 routed_tokens={name: routed.get(name, zeros) for name in self.routed_names})
            for capture in captures:
                capture.finish(scores)
        finally:
            for capture in captures:
                capture.release()
        return scores


class _Passed(NamedTuple):
    """A pass's per-sample values on the host (pinned tensors copies fills: wait before reading)."""

    loss: torch.Tensor
    count: torch.Tensor
    finite: torch.Tensor
    stats: dict[str, torch.Tensor]
    copies: HostCopies


@contextmanager
def borrowed(model: nn.Module) -> Iterator[None]:
    """The model in eval mode with frozen parameters (input-gradient backward only), then every
    module's mode and every parameter's requires_grad as they were: an engine built inside a
    training script must not stop its training."""
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    if any(training for _, training in modes):  # a scoring run's model is already in eval mode and frozen:
        model.eval()  # nothing to walk again per batch
    for p, requires_grad in grads:
        if requires_grad:
            p.requires_grad_(False)
    try:
        yield
    finally:
        for m, training in modes:
            if m.training != training:
                m.training = training
        for p, requires_grad in grads:
            if requires_grad:
                p.requires_grad_(True)
