"""Exact per-sample gradient spectra for a padded batch, from one forward and one backward.

Parameters are frozen, so the backward computes input gradients only: no weight-gradient
GEMMs and no ``.grad`` buffers. Hooks capture each scored module's input X (T x d_in) and
output gradient D (T x d_out) per sample; the sample's weight gradient is G = D^T X. Its
singular values come from the smallest of the three sizes: the T x T core problem from
X X^T and D D^T when T is smallest, else the Gram of the materialised G.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from gradspec.kernels import token_mask
from gradspec.layers.targets import Part, Target, select_targets
from gradspec.linalg import eigen as spectral
from gradspec.linalg.eigen import core_spectra, eigen_faults, eigen_path, gram_spectra, segment_gram
from gradspec.linalg.host_copies import HostCopies
from gradspec.linalg.lowrank import LOWRANK_METRICS, lowrank_metrics, sketch_matrix, sketch_singular_values
from gradspec.linalg.metrics import METRICS
from gradspec.linalg.policy import Policy

IGNORE_INDEX = -100
log = logging.getLogger("gradspec")
# ||G||_F^2 from the spectrum vs <D D^T, X X^T>: 1e-3 relative, or 1e5 epsilons of the Grams' precision
FROBENIUS_CHECK_RTOL = 1e-3


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


def response_loss_per_sample(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over each sample's labelled tokens -> (loss (N,), count (N,))."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    tok = nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view(shift_labels.shape)
    count = (shift_labels != IGNORE_INDEX).sum(1)
    return tok.sum(1) / count.clamp_min(1), count


# Per model: whether its logits are its output embeddings applied to its base model's last hidden
# state, as the head shortcut assumes (checked once, on the first batch it scores).
_HEAD_SHORTCUT: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _shortcut_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows, cols):
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return model.get_output_embeddings()(hidden.last_hidden_state[rows, cols])


@torch.no_grad()
def check_head_shortcut(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> bool:
    """Whether the LM head may be applied at labelled positions alone for this model: its output
    embeddings on the base model's hidden states must give the model's own logits. Models that
    transform their logits (soft-capping, scaling under any name, e.g. Granite's
    ``logits_scaling``) fail the check, with a warning, and take the full path. Checked once per
    model, on the first sample of a batch that has labelled tokens; call it outside any hooks."""
    if model in _HEAD_SHORTCUT:
        return _HEAD_SHORTCUT[model]
    if model.get_output_embeddings() is None or not hasattr(model, "base_model"):
        _HEAD_SHORTCUT[model] = False
        return False
    labelled = torch.nonzero((labels[:, 1:] != IGNORE_INDEX).any(1)).flatten()
    if len(labelled) == 0:
        return True  # nothing to compare on yet: no logits are needed for this batch either
    i = labelled[:1]
    ids, mask = input_ids[i], attention_mask[i]
    rows, cols = torch.nonzero(labels[i, 1:] != IGNORE_INDEX, as_tuple=True)
    full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[rows, cols].float()
    short = _shortcut_logits(model, ids, mask, rows, cols).float()
    tol = max(1e-4, 16 * torch.finfo(model.get_output_embeddings().weight.dtype).eps)
    ok = bool((short - full).abs().max() <= tol * full.abs().max().clamp_min(1e-30))
    if not ok:
        log.warning("%s's logits are not its output embeddings of its hidden states (scaled or capped logits): "
                    "the LM head runs at every position", type(model).__name__)
    _HEAD_SHORTCUT[model] = ok
    return ok


def response_losses(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
    token_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample mean response loss and labelled-token count, with the LM head applied at
    labelled positions only; with token_stats also the mean predictive entropy, the
    teacher-forced token accuracy and the mean probability of the target token over those positions.

    Prompt positions need no logits: skipping them saves the head's forward and backward
    there. A model whose logits are more than its head of its hidden states takes the full
    path (check_head_shortcut).
    """
    target = labels[:, 1:]
    rows, cols = torch.nonzero(target != IGNORE_INDEX, as_tuple=True)
    if check_head_shortcut(model, input_ids, attention_mask, labels):
        logits = _shortcut_logits(model, input_ids, attention_mask, rows, cols)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[rows, cols]
    logits, wanted = logits.float(), target[rows, cols]
    count = torch.bincount(rows, minlength=len(labels))

    def per_sample(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(labels), dtype=values.dtype, device=values.device).index_add(0, rows, values) / (
            count.clamp_min(1))

    loss = per_sample(nn.functional.cross_entropy(logits, wanted, reduction="none"))
    stats: dict[str, torch.Tensor] = {}
    if token_stats:
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            stats["mean_entropy"] = per_sample(-(logp.exp() * logp).sum(-1)).double().cpu()
            stats["token_accuracy"] = per_sample((logits.argmax(-1) == wanted).float()).double().cpu()
            target_logp = logp.gather(1, wanted[:, None]).squeeze(1)
            stats["mean_token_prob"] = per_sample(target_logp.exp()).double().cpu()
    return loss, count, stats


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
        self.sketch = _Sketch(rank, power_iters, seed) if method == "lowrank" else None
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
        with spectral.DISPATCH.lock:
            return self._finish(*work)

    def _forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        # The batch's one host synchronisation: its lengths, from which every split is decided.
        mask = attention_mask.cpu().bool()
        lengths = mask.sum(1)
        if not torch.equal(mask, token_mask(lengths, mask.shape[1], "cpu")):
            raise ValueError("the batch must be right-padded (attention_mask a prefix of ones)")
        capture = Capture(self.targets, lengths, self.policy, self.sketch, self.metric_names,
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
        self, capture: Capture, loss: torch.Tensor, count: torch.Tensor, finite: torch.Tensor,
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


class _Sketch:
    """Settings of the low-rank method, and one seeded test matrix per module part."""

    def __init__(self, rank: int, power_iters: int, seed: int) -> None:
        if rank < 1 or power_iters < 0:
            raise ValueError(f"--rank must be >= 1 and power iterations >= 0, got {rank}, {power_iters}")
        self.rank, self.power_iters, self.seed = rank, power_iters, seed
        self.omegas: dict[str, torch.Tensor] = {}

    def omega(self, part: Part, d_in: int, device: torch.device) -> torch.Tensor:
        """The part's Omega on device (made and copied there once, not per batch)."""
        if part.name not in self.omegas:
            seed = self.seed * 1_000_003 + len(self.omegas)
            self.omegas[part.name] = sketch_matrix(d_in, part.d_out, self.rank, seed)
        if self.omegas[part.name].device != device:
            self.omegas[part.name] = self.omegas[part.name].to(device)
        return self.omegas[part.name]


@dataclass
class _Samples:
    """Some samples of a batch: their rows on the host, and a gather index on the device (None
    when they are the whole batch: a slice, no copy); T is the longest of them."""

    rows: tuple[int, ...]
    index: torch.Tensor | None
    T: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.index is None else t[self.index]


class Capture:
    """Hook state for one batch: inputs in the forward, reductions as gradients arrive.

    Which samples take the core path, and how many tokens each reduction spans, are decided from
    the lengths on the host, once per batch: the hooks never wait for the device. scale
    multiplies each sample's output gradient (e.g. from a training loss's share back to the
    sample's own mean loss)."""

    def __init__(
        self, targets: list[Target], lengths: torch.Tensor, policy: Policy | str, sketch: _Sketch | None,
        metric_names: tuple[str, ...], scale: torch.Tensor | None = None, device: torch.device | str | None = None,
    ) -> None:
        self.targets = targets
        self.policy = Policy.of(policy)
        self.metric_names = metric_names
        self.device = torch.device(device) if device is not None else lengths.device
        self.lengths = lengths.cpu().to(torch.int64)
        self.device_lengths = self.lengths.to(self.device, non_blocking=True)
        self.scale = None if scale is None else scale.to(self.device).view(-1, 1, 1)
        self.sketch = sketch
        self.sketched: list[tuple[Part, torch.Tensor, torch.Tensor]] = []  # (part, top-k sigma, ||G||_F^2)
        self.inputs: dict[str, torch.Tensor] = {}
        self.x_grams: dict[tuple, tuple[_Samples, torch.Tensor]] = {}  # input -> (samples, X X^T)
        # (input, samples, T) -> (X X^T, [(part, D D^T, <D D^T, X X^T>)])
        self.core: dict[tuple, tuple[torch.Tensor, list]] = {}
        self.materialised: list[tuple[Part, tuple[int, ...], torch.Tensor]] = []  # (part, samples, Gram of G)
        self.measures = False  # whether an eigen stage will be measured on this batch (set by to_host)
        self._splits: dict[int, tuple[_Samples, _Samples]] = {}
        self._copies = HostCopies()

    def _samples(self, rows: list[int]) -> _Samples:
        T = max((int(self.lengths[i]) for i in rows), default=0)
        whole = rows == list(range(len(self.lengths)))
        index = None if whole else torch.tensor(rows).to(self.device, non_blocking=True)
        return _Samples(tuple(rows), index, T)

    def _split(self, n: int) -> tuple[_Samples, _Samples]:
        """(samples shorter than n tokens, the rest): the core path for a module whose smaller
        side is n, and the materialised one."""
        if n not in self._splits:
            short = (self.lengths < n).tolist()
            self._splits[n] = (self._samples([i for i, s in enumerate(short) if s]),
                               self._samples([i for i, s in enumerate(short) if not s]))
        return self._splits[n]

    @contextmanager
    def hooks(self, model: nn.Module) -> Iterator[None]:
        handles = [model.get_input_embeddings().register_forward_hook(_require_grad)]
        handles += [t.module.register_forward_hook(self._forward_hook(t)) for t in self.targets]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _forward_hook(self, target: Target):
        def hook(module, args, output):
            self.inputs[target.name] = args[0].detach()
            output.register_hook(lambda grad: self._on_grad(target, grad.detach()))

        return hook

    def _on_grad(self, target: Target, grad: torch.Tensor) -> None:
        # Reduced as soon as the gradient arrives; the input is released here (its storage goes
        # once every module reading it is done), so only the T x T products stay in flight.
        X = self.inputs.pop(target.name)
        if self.scale is not None:
            grad = grad * self.scale.to(grad.dtype)
        for part in target.parts:
            D = grad[..., part.start : part.start + part.d_out]
            if self.sketch is not None:
                s = self.sketch
                omega = s.omega(part, target.d_in, X.device)
                self.sketched.append((part, *sketch_singular_values(
                    X, D, self.device_lengths, omega, s.rank, s.power_iters, self.policy)))
                continue
            core, materialised = self._split(min(target.d_in, part.d_out))
            if core.rows:
                key = (_input_key(X), core.rows, core.T)
                if key not in self.core:
                    self.core[key] = (self._x_gram(X, core, target.d_in), [])
                B, items = self.core[key]
                A, inner = segment_gram(core.take(D)[:, :core.T], core.take(self.device_lengths), B, self.policy)
                items.append((part, A, inner))
            if materialised.rows:
                dtype, lengths = self.policy.dtype, materialised.take(self.device_lengths)
                Xs = materialised.take(X).to(dtype) * token_mask(lengths, X.shape[1], X.device)[..., None]
                G = materialised.take(D).to(dtype).transpose(1, 2) @ Xs  # (n, d_out, d_in)
                gram = G @ G.transpose(1, 2) if part.d_out <= target.d_in else G.transpose(1, 2) @ G
                self.materialised.append((part, materialised.rows, gram))

    def _x_gram(self, X: torch.Tensor, core: _Samples, d_in: int) -> torch.Tensor:
        """X X^T for these samples, from one Gram per input shared by all modules that read it
        (over every sample shorter than d_in, a superset of any module's core samples)."""
        key = _input_key(X)
        if key not in self.x_grams:
            wide = self._split(d_in)[0]
            gram = segment_gram(wide.take(X)[:, :wide.T], wide.take(self.device_lengths), policy=self.policy)[0]
            self.x_grams[key] = (wide, gram)
        wide, gram = self.x_grams[key]
        if core.rows != wide.rows:
            position = {row: k for k, row in enumerate(wide.rows)}
            gram = gram[torch.tensor([position[r] for r in core.rows]).to(gram.device, non_blocking=True)]
        return gram[:, :core.T, :core.T]

    def to_host(self) -> None:
        """Move what the eigen stage needs on the host to the CPU, on the caller's thread (so the
        copies do not queue behind the next batch's GPU work), and drop the rest. Grams whose
        eigen stage runs on the GPU, or is still to be measured, stay there."""
        self.inputs.clear()
        self.x_grams.clear()
        copies = self._copies
        paths = set()

        def move_for(grams: torch.Tensor, stage: str):
            """Copies to the host where this stage's eigen path runs there; else leaves tensors be."""
            path = eigen_path(grams, self.policy, stage)
            paths.add(path)
            return copies if path == "cpp" else (lambda t: t)

        core = {}
        for key, (B, items) in self.core.items():
            move = move_for(B, "core")  # B and its A's are solved together, on one path
            core[key] = (move(B), [(part, move(A), copies(inner)) for part, A, inner in items])
        self.core = core
        self.materialised = [(part, samples, move_for(gram, "gram")(gram)) for part, samples, gram in self.materialised]
        self.sketched = [(part, copies(sigma), copies(frob2)) for part, sigma, frob2 in self.sketched]
        self.measures = None in paths
        copies.wait()

    def release(self) -> None:
        """Gives the pinned host buffers back once the eigen stage has read them."""
        self.core, self.materialised, self.sketched = {}, [], []
        self._copies.release()

    def reduce(self, finite: torch.Tensor, flags: list[set[str]], keep_spectra: bool):
        N = len(self.lengths)
        nan = float("nan")
        metrics = {p.name: torch.full((N, len(self.metric_names)), nan, dtype=torch.float64)
                   for t in self.targets for p in t.parts}
        spectra: dict[str, list[np.ndarray]] = {name: [np.zeros(0)] * N for name in metrics} if keep_spectra else {}

        def record(part: Part, samples: tuple[int, ...], sigma: torch.Tensor, m: torch.Tensor, ok: torch.Tensor,
                   failed: set[int]) -> None:
            for row, i in enumerate(samples):
                if not finite[i]:
                    continue
                if row in failed:
                    flags[i].add("eigen_failed")
                    continue
                if not ok[row]:
                    flags[i].add("nonfinite_gradient")
                    continue
                metrics[part.name][i] = m[row]
                if not m[row, 0] >= 1e-12:
                    flags[i].add("zero_gradient")
                if keep_spectra:
                    s = sigma[row].numpy()
                    spectra[part.name][i] = s[s > 0]

        for (_, samples, _), (B, items) in self.core.items():
            A = torch.stack([a for _, a, _ in items], 1)
            ok = _finite_rows(B) & _finite_rows(A)
            lengths = self.lengths[list(samples)]
            terms = max(max(part.d_in, part.d_out) for part, _, _ in items)
            (sigma, m), failed = _isolating_failures(
                partial(core_spectra, policy=self.policy, terms=terms), _zero_rows(B, ok), _zero_rows(A, ok), lengths)
            for j, (part, _, inner) in enumerate(items):
                record(part, samples, sigma[:, j], m[:, j], ok, failed)
                frob2 = m[:, j, METRICS.index("frobenius_norm")] ** 2
                rtol = max(FROBENIUS_CHECK_RTOL, 1e5 * self.policy.eps)
                bad = ok & ~torch.isclose(frob2, inner.double().cpu(), rtol=rtol, atol=1e-30)
                for row in torch.nonzero(bad).flatten().tolist():
                    if row not in failed:
                        flags[samples[row]].add("frobenius_check_failed")
        everyone = tuple(range(N))
        for part, sigma, frob2 in self.sketched:
            record(part, everyone, sigma, lowrank_metrics(sigma, frob2), torch.isfinite(frob2), set())
        for part, samples, gram in self.materialised:
            ok = _finite_rows(gram)
            solve = partial(gram_spectra, policy=self.policy, terms=max(part.d_in, part.d_out))
            (sigma, m), failed = _isolating_failures(solve, _zero_rows(gram, ok))
            record(part, samples, sigma, m, ok, failed)
        return metrics, spectra


def _isolating_failures(solve, *batched: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], set[int]]:
    """solve(*batched) -> (sigma, metrics); where it fails even on the host (the eigen stage has
    retried it there), each sample alone, so that only the samples that fail by themselves are
    lost: their rows come back in the failed set, with zero sigma and NaN metrics."""
    try:
        return solve(*batched), set()
    except eigen_faults() as error:
        log.warning("eigen stage failed on a batch of %d (%s: %s); solving its samples one by one",
                    len(batched[0]), type(error).__name__, error)
    # sigma is (1, ..., n) per sample: the Grams' shape less one side (A's for the core, G's Gram's)
    sigma_shape = [t for t in batched if t.is_floating_point()][-1].shape[1:-1]
    sigmas, metrics, failed = [], [], set()
    for i in range(len(batched[0])):
        try:
            sigma, m = solve(*(t[i : i + 1] for t in batched))
        except eigen_faults():
            failed.add(i)
            sigma = torch.zeros(1, *sigma_shape, dtype=torch.float64)
            m = torch.full((1, *sigma_shape[:-1], len(METRICS)), float("nan"), dtype=torch.float64)
        sigmas.append(sigma)
        metrics.append(m)
    return (torch.cat(sigmas), torch.cat(metrics)), failed


def _input_key(X: torch.Tensor) -> tuple:
    """Identifies one input tensor across the modules that read it (q, k, v; gate, up). Every
    captured input is alive at the end of the forward, so no two share an address in a batch."""
    return (X.data_ptr(), tuple(X.shape), X.stride())


def _finite_rows(t: torch.Tensor) -> torch.Tensor:
    """Per leading index, whether a batch of Grams is finite: a Gram's diagonal holds every
    row's squared norm, so a NaN or inf anywhere in Y shows there, and a finite diagonal
    bounds every entry (Cauchy-Schwarz)."""
    return torch.isfinite(t.diagonal(dim1=-2, dim2=-1)).flatten(1).all(1).cpu()


def _zero_rows(t: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return t if bool(ok.all()) else torch.where(ok.to(t.device).view(-1, *[1] * (t.dim() - 1)), t, 0.0)


def _require_grad(module, args, output):
    """Make the embeddings' output require grad, so the backward reaches every hooked module."""
    output.requires_grad_(True)

