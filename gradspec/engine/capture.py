"""The spectra's capture for one batch (gradspec.layers.hooks): each part's per-sample Grams (or
materialised G) as its output gradient D arrives in the backward, and the eigen stage that turns
them into spectra and metrics (reduce).

Which samples take the core path (T x T problem from X X^T and D D^T) and which the materialised
one (the Gram of G = D^T X), and how many tokens each reduction spans, are decided from the lengths
on the host once per batch: the hooks never wait for the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from gradspec.layers.hooks import BatchLayout, Capture, Captured
from gradspec.layers.registry import Part, Target
from gradspec.linalg import extension, stages
from gradspec.linalg.eigen import (
    core_spectra,
    eigen_faults,
    eigen_path,
    gram_spectra,
    host_core_spectra,
    host_gram_spectra,
)
from gradspec.linalg.grams import product_gram, segment_gram
from gradspec.linalg.host_copies import HostCopies, to_device
from gradspec.linalg.lowrank import lowrank_metrics, sketch_gram, sketch_matrix, sketch_singular_values
from gradspec.linalg.metrics import ordered_sum
from gradspec.linalg.policy import Policy
from gradspec.options import OptionError

log = logging.getLogger("gradspec")
Result = TypeVar("Result")
# ||G||_F^2 from the spectrum vs <D D^T, X X^T>: 1e-3 relative, or 1e5 epsilons of the Grams' precision
FROBENIUS_CHECK_RTOL = 1e-3


class LowRankSketch:
    """Settings of the low-rank method, and one seeded test matrix per module part."""

    def __init__(self, rank: int, power_iters: int, seed: int) -> None:
        if rank < 1 or power_iters < 0:
            raise OptionError(("rank", "power_iters"), f"must be at least 1 and 0, got {rank} and {power_iters}")
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
    """Some samples of a Captured: their rows in it and in the batch, their lengths on the host, their
    index on the host for the Gram stages (None when they are all of it); T is the longest of them."""

    rows: tuple[int, ...]
    batch_rows: tuple[int, ...]
    lengths: torch.Tensor
    index: torch.Tensor | None
    T: int


class _Solved(NamedTuple):
    """One part's eigen stage over some samples: sigma and metrics per sample, which rows were
    finite, failed, or failed the Frobenius cross-check (positions in batch_rows). Row k's part is
    part.member(k): a Stack's rows are many parts'."""

    part: Part
    batch_rows: tuple[int, ...]
    sigma: torch.Tensor
    metrics: torch.Tensor
    ok: torch.Tensor
    failed: set[int]
    frobenius_off: list[int]


@dataclass
class _CoreGroup:
    """The parts that share one input and one set of samples: B = X X^T, and per part (part, D D^T, <D D^T, B>)."""

    B: torch.Tensor
    lengths: torch.Tensor
    batch_rows: tuple[int, ...]
    items: list = field(default_factory=list)


class BatchCapture(Capture):
    """The spectra of one batch: Grams as gradients arrive, the eigen stage after (reduce).

    Which samples take the core path, and how many tokens each reduction spans, are decided from the
    lengths on the host: the hooks never wait for the device. scale multiplies each sample's output
    gradient (e.g. from a training loss's share back to the sample's own mean loss)."""

    def __init__(
        self, targets: list[Target], batch: BatchLayout, policy: Policy | str, sketch: LowRankSketch | None,
        metric_names: tuple[str, ...], scale: torch.Tensor | None = None, keep_spectra: bool = False,
        eager: bool = False,
    ) -> None:
        super().__init__(targets, batch)
        self.policy = Policy.of(policy)
        self.metric_names = metric_names
        self.keep_spectra = keep_spectra
        self.device = batch.device
        self.scale = None if scale is None else to_device(scale, self.device).view(-1, 1, 1)
        self.sketch = sketch
        self.sketched: list[tuple[Part, tuple[int, ...], torch.Tensor, torch.Tensor]] = []  # (part, rows, gram, frob2)
        self.x_grams: dict[tuple, tuple[_Samples, torch.Tensor]] = {}  # (input, samples' T) -> (samples, X X^T)
        self.core: dict[tuple, _CoreGroup] = {}  # (input, samples, T) -> its group
        self.materialised: list[tuple[Part, tuple[int, ...], torch.Tensor]] = []  # (part, batch rows, Gram of G)
        self._splits: dict[tuple, tuple[_Samples, _Samples]] = {}
        self._copies = HostCopies()
        self._delivered: set[str] = set()
        # per input: (bytes per token of its X, each part's smaller side): what batch_memory models
        self.inputs: dict = {}
        # eager: each input's eigen stage as soon as its tensor is gone, not after the backward (about
        # one layer's Grams held instead of all of them; the host waits for the device there); also
        # wherever the hooks find themselves in a checkpointed region (BatchLayout.checkpointed)
        self.eager = eager
        self.solved: list[_Solved] = []

    def _samples(self, captured: Captured, rows: list[int]) -> _Samples:
        lengths = captured.lengths[rows]
        whole = rows == list(range(len(captured.lengths)))
        index = None if whole else torch.tensor(rows)
        return _Samples(tuple(rows), tuple(captured.batch_row(i) for i in rows), lengths, index,
                        int(lengths.max()) if rows else 0)

    def _split(self, captured: Captured, n: int) -> tuple[_Samples, _Samples]:
        """(samples shorter than n tokens, the rest): the core path for a module whose smaller side
        is n, and the materialised one."""
        key = (captured.layout, n)
        if key not in self._splits:
            short = (captured.lengths < n).tolist()
            self._splits[key] = (self._samples(captured, [i for i, s in enumerate(short) if s]),
                                 self._samples(captured, [i for i, s in enumerate(short) if not s]))
        return self._splits[key]

    @property
    def takes_stacks(self) -> bool:
        """Stacks of many parts' rows (experts): each row's part is its own; a sketch's test matrix is per part."""
        return self.sketch is None

    def on_part(self, part: Part, captured: Captured) -> None:
        if part.name in self._delivered:  # a module called twice: one call's spectrum would be wrong
            self.batch.repeated.update(part.member(k).name for k in range(len(captured.lengths)))
            return
        self._delivered.add(part.name)
        X, D = captured.X, captured.D
        self.inputs.setdefault(captured.input_key, (X.shape[-1] * X.element_size(), []))[1].append(
            min(part.d_in, part.d_out))
        if self.eager or self.batch.checkpointed:
            self._solve_freed()
        if self.scale is not None:
            dtype = torch.promote_types(D.dtype, torch.float32)  # a bf16 product would round the scale
            D = D.to(dtype) * captured.of_rows(self.scale).to(D.device, dtype)
        if self.sketch is not None:
            s = self.sketch
            omega = s.omega(part, part.d_in, X.device)
            self.sketched.append((part, captured.batch_rows, *sketch_gram(
                X, D, captured.device_lengths, omega, s.power_iters, self.policy)))
            return
        core, materialised = self._split(captured, min(part.d_in, part.d_out))
        if core.rows:
            key = (captured.input_key, core.batch_rows, core.T)
            if key not in self.core:
                self.core[key] = _CoreGroup(self._x_gram(captured, core, part.d_in), core.lengths, core.batch_rows)
            group = self.core[key]
            A, inner = segment_gram(D[:, :core.T], captured.device_lengths, group.B, self.policy, core.index)
            group.items.append((part.take(core.rows), A, inner))
        if materialised.rows:
            gram = self._materialised_gram(part, captured, materialised, D)
            part = part.take(materialised.rows)
            if self.eager or self.batch.checkpointed:
                self.solved.extend(self._solve_gram(part, materialised.batch_rows, self._for_eigen(gram, "gram")))
            else:
                self.materialised.append((part, materialised.batch_rows, gram))

    def _materialised_gram(self, part: Part, captured: Captured, samples: _Samples, D: torch.Tensor) -> torch.Tensor:
        """The smaller Gram of G = D^T X per sample, at the policy's precision (grams.product_gram). The
        torch path forms it from the input's X X^T where that holds these samples (each shorter than d_in)."""
        return product_gram(D, captured.X, captured.device_lengths, samples.index, samples.T, self.policy,
                            partial(self._x_gram, captured, samples, part.d_in))

    def _x_gram(self, captured: Captured, core: _Samples, d_in: int) -> torch.Tensor:
        """X X^T for these samples, from one Gram per input shared by all parts that read it (over
        every sample shorter than d_in, a superset of these samples)."""
        key = captured.input_key
        if key not in self.x_grams:
            wide = self._split(captured, d_in)[0]
            gram = segment_gram(captured.X[:, :wide.T], captured.device_lengths, None, self.policy, wide.index)[0]
            self.x_grams[key] = (wide, gram)
        wide, gram = self.x_grams[key]
        if core.rows != wide.rows:
            position = {row: k for k, row in enumerate(wide.rows)}
            gram = gram[to_device(torch.tensor([position[r] for r in core.rows]), gram.device)]
        return gram[:, :core.T, :core.T]

    def to_host(self) -> None:
        """Queue copies to the host of what the eigen stage needs there (on a side stream, after this
        batch's work: the next batch's does not wait for them), and drop the rest; the eigen stage
        waits for them (wait_host). Grams whose eigen stage runs on the GPU, or is still to be
        measured, stay there."""
        self.x_grams.clear()
        stages.DISPATCH.tick()  # a batch more towards re-measuring a path that failed in a measurement
        copies = self._copies
        paths = set()

        def copier_for(grams: torch.Tensor, stage: str):
            """Copies to the host where this stage's eigen path runs there; else leaves tensors be."""
            path = eigen_path(grams, self.policy, stage)
            paths.add(path)
            return copies if path == "cpp" else (lambda t: t)

        for group in self.core.values():
            move = copier_for(group.B, "core")  # B and its A's are solved together, on one path
            group.B = move(group.B)
            group.items = [(part, move(A), copies(inner)) for part, A, inner in group.items]
        self.materialised = [(part, rows, copier_for(gram, "gram")(gram)) for part, rows, gram in self.materialised]
        self.sketched = [(part, rows, copies(gram), copies(frob2)) for part, rows, gram, frob2 in self.sketched]
        self.measures = None in paths
        copies.queued()

    def wait_host(self) -> None:
        self._copies.wait()

    def release(self) -> None:
        """Drops the batch's Grams and host copies once the eigen stage has read them (or failed)."""
        self.core, self.materialised, self.sketched, self.solved, self.inputs, self.x_grams = {}, [], [], [], {}, {}

    def finish(self, scores) -> None:
        scores.metrics, scores.spectra = self.reduce(scores.scored, scores.flags, self.keep_spectra)

    def _at_once(self, items: list, stage: str, grams_of, job, alone) -> list[_Solved]:
        """The eigen stage of several items (core groups, or materialised parts): those whose path is
        the host's in one job of the extension over all their samples (job; an item of one or two
        samples alone would leave threads idle), the others, and all of them where that job fails,
        one by one (alone)."""
        host = [x for x in items if len(items) > 1 and extension.BUILT and not grams_of(x).is_cuda
                and eigen_path(grams_of(x), self.policy, stage) == "cpp"]
        solved: list[_Solved] = []
        if host:
            try:
                solved = job(host)
            except eigen_faults() as error:
                log.warning("%s eigen stage failed on %d items at once (%s: %s); solving each alone", stage,
                            len(host), type(error).__name__, error)
                host = []
        joint = {id(x) for x in host}
        return solved + [r for x in items if id(x) not in joint for r in alone(x)]

    def _solve_cores(self, groups: list[_CoreGroup]) -> list[_Solved]:
        return self._at_once(groups, "core", lambda g: g.B, self._cores_job, self._solve_core)

    def _cores_job(self, groups: list[_CoreGroup]) -> list[_Solved]:
        oks = [_finite_rows(g.B) & torch.stack([_finite_rows(a) for _, a, _ in g.items]).all(0) for g in groups]
        results = host_core_spectra(
            [(_zero_rows(g.B, ok), [_zero_rows(a, ok) for _, a, _ in g.items], g.lengths, _terms(g))
             for g, ok in zip(groups, oks, strict=True)], self.policy, self.metric_names)
        return [r for g, ok, (sigma, m) in zip(groups, oks, results, strict=True)
                for r in self._cross_checked(g, sigma, m, ok, set())]

    def _solve_grams(self, materialised: list[tuple[Part, tuple[int, ...], torch.Tensor]]) -> list[_Solved]:
        return self._at_once(materialised, "gram", lambda x: x[2], self._grams_job, lambda x: self._solve_gram(*x))

    def _grams_job(self, materialised: list[tuple[Part, tuple[int, ...], torch.Tensor]]) -> list[_Solved]:
        oks = [_finite_rows(gram) for _, _, gram in materialised]
        results = host_gram_spectra([(_zero_rows(gram, ok), max(part.d_in, part.d_out))
                                     for (part, _, gram), ok in zip(materialised, oks, strict=True)],
                                    self.policy, self.metric_names)
        return [_Solved(part, rows, sigma, m, ok, set(), [])
                for (part, rows, _), ok, (sigma, m) in zip(materialised, oks, results, strict=True)]

    def _solve_core(self, group: _CoreGroup) -> list[_Solved]:
        """The eigen stage of one input's parts, with the Frobenius cross-check of each."""
        solve = partial(core_spectra, policy=self.policy, terms=_terms(group), metrics=self.metric_names)

        def solved(B: torch.Tensor, *As: torch.Tensor):
            A = torch.stack(As, 1)
            ok = _finite_rows(B) & _finite_rows(A)
            return *_isolating_failures(solve, len(self.metric_names), _zero_rows(B, ok), _zero_rows(A, ok),
                                        group.lengths), ok

        ((sigma, m), failed, ok) = _on_host_if_out_of_memory(solved, group.B, *(a for _, a, _ in group.items))
        return self._cross_checked(group, sigma, m, ok, failed)

    def _cross_checked(self, group: _CoreGroup, sigma: torch.Tensor, m: torch.Tensor, ok: torch.Tensor,
                       failed: set[int]) -> list[_Solved]:
        """Each part's spectra, with the Frobenius cross-check: sum sigma^2 against <D D^T, X X^T>."""
        rtol = max(FROBENIUS_CHECK_RTOL, 1e5 * self.policy.eps)
        out = []
        for j, (part, _, inner) in enumerate(group.items):
            frob2 = ordered_sum(sigma[:, j] ** 2)
            bad = ok & ~torch.isclose(frob2, inner.double().cpu(), rtol=rtol, atol=1e-30)
            off = [row for row in torch.nonzero(bad).flatten().tolist() if row not in failed]
            out.append(_Solved(part, group.batch_rows, sigma[:, j], m[:, j], ok, failed, off))
        return out

    def _solve_gram(self, part: Part, rows: tuple[int, ...], gram: torch.Tensor) -> list[_Solved]:
        solve = partial(gram_spectra, policy=self.policy, terms=max(part.d_in, part.d_out), metrics=self.metric_names)

        def solved(gram: torch.Tensor):
            ok = _finite_rows(gram)
            return *_isolating_failures(solve, len(self.metric_names), _zero_rows(gram, ok)), ok

        ((sigma, m), failed, ok) = _on_host_if_out_of_memory(solved, gram)
        return [_Solved(part, rows, sigma, m, ok, failed, [])]

    def _sketch_solved(self, part: Part, rows: tuple[int, ...], gram: torch.Tensor, frob2: torch.Tensor) -> _Solved:
        """A sketched part's top singular values from its k x k Grams, and its metrics."""
        ok = torch.isfinite(frob2) & _finite_rows(gram)
        sigma = sketch_singular_values(_zero_rows(gram, ok), self.sketch.rank, self.policy.eps, part.d_in)
        return _Solved(part, rows, sigma, lowrank_metrics(sigma, frob2, self.metric_names), ok, set(), [])

    def _solve_freed(self) -> None:
        """Eager: the eigen stage of every input whose tensor is gone (every part reading it has
        delivered), so that its Grams are not held to the end of the backward."""
        for key in [k for k in self.x_grams if _gone(k)]:
            del self.x_grams[key]
        for key in [k for k in self.core if _gone(k[0])]:
            group = self.core.pop(key)
            group.B = self._for_eigen(group.B, "core")
            group.items = [(part, A.to(group.B.device), inner) for part, A, inner in group.items]
            self.solved.extend(self._solve_core(group))

    def _for_eigen(self, grams: torch.Tensor, stage: str) -> torch.Tensor:
        """Eager: on the host where this stage's eigen path runs there (a synchronous copy)."""
        return grams.cpu() if eigen_path(grams, self.policy, stage) == "cpp" else grams

    def reduce(self, finite: torch.Tensor, flags: list[set[str]], keep_spectra: bool):
        """({part: (N, metrics)}, {part: [sigma per sample]}) for the samples with a finite loss; a
        part a sample did not reach keeps NaN there, unflagged where the part is routed, else
        flagged missing_gradient (its output gradient never came: e.g. hooks removed before the backward);
        a part whose module ran twice (its gradient a sum over calls) is NaN and flagged repeated_call."""
        self.wait_host()
        N = self.batch.N
        nan = float("nan")
        finite = finite.numpy().tolist()
        # numpy while rows are recorded one by one (a torch element assignment costs several microseconds)
        metrics = {p.name: np.full((N, len(self.metric_names)), nan) for t in self.targets for p in t.parts}
        spectra: dict[str, list[np.ndarray]] = {name: [np.zeros(0)] * N for name in metrics} if keep_spectra else {}

        reached: set[tuple[str, int]] = set()

        def record(parts: Part, samples: tuple[int, ...], sigma: torch.Tensor, m: torch.Tensor, ok: torch.Tensor,
                   failed: set[int]) -> None:
            m, ok, sigma = m.numpy(), ok.numpy().tolist(), sigma.numpy()
            for row, i in enumerate(samples):
                part = parts.member(row)
                reached.add((part.name, i))
                if not finite[i]:
                    continue
                if row in failed:
                    flags[i].add("eigen_failed")
                    continue
                if not ok[row]:
                    flags[i].add("nonfinite_gradient")
                    continue
                metrics[part.name][i] = m[row]
                if not m[row, 0] >= 1e-12 and not part.routed:  # an expert reached only by tokens without loss
                    flags[i].add("zero_gradient")
                if keep_spectra:
                    spectra[part.name][i] = sigma[row][sigma[row] > 0]

        solved = self.solved + self._solve_cores(list(self.core.values()))
        solved += [self._sketch_solved(part, rows, gram, frob2) for part, rows, gram, frob2 in self.sketched]
        solved += self._solve_grams(self.materialised)
        for r in solved:
            record(r.part, r.batch_rows, r.sigma, r.metrics, r.ok, r.failed)
            for row in r.frobenius_off:
                flags[r.batch_rows[row]].add("frobenius_check_failed")
        for t in self.targets:
            for part in t.parts:
                for i in range(N):
                    if not finite[i]:
                        continue
                    if part.name in self.batch.repeated:
                        metrics[part.name][i] = nan
                        flags[i].add("repeated_call")
                    elif not part.routed and (part.name, i) not in reached:
                        flags[i].add("missing_gradient")
        metrics = {name: torch.from_numpy(values) for name, values in metrics.items()}
        return metrics, spectra


def _isolating_failures(solve, columns: int, *batched: torch.Tensor
                        ) -> tuple[tuple[torch.Tensor, torch.Tensor], set[int]]:
    """solve(*batched) -> (sigma, metrics of `columns` values); where it fails even on the host (the eigen stage has
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
            m = torch.full((1, *sigma_shape[:-1], columns), float("nan"), dtype=torch.float64)
        sigmas.append(sigma)
        metrics.append(m)
    return (torch.cat(sigmas), torch.cat(metrics)), failed


def _gone(input_key) -> bool:
    """Whether no part reading this input can still be delivered: a dense input's tensor freed (InputKey),
    an experts bucket delivered (layers.experts._Segments); other keys live to the end of the backward."""
    return hasattr(input_key, "alive") and not input_key.alive()


def _terms(group: _CoreGroup) -> int:
    """The longest sum the group's Grams were formed from: their rounding's scale (eigenvalue cut-offs)."""
    return max(max(part.d_in, part.d_out) for part, _, _ in group.items)


def _on_host_if_out_of_memory(solved: Callable[..., Result], *grams: torch.Tensor) -> Result:
    """solved(*grams); where the GPU runs out of memory around the solve (stacking, zeroing a batch's
    Grams: the solve itself is retried on the host by the eigen stage), solved again on copies on the
    host, once the failed attempt's memory is free (its frames live as long as the except block)."""
    try:
        return solved(*grams)
    except torch.OutOfMemoryError as error:
        if not any(g.is_cuda for g in grams):
            raise
        log.warning("out of GPU memory in the eigen stage (%s); solving it on the host", str(error))  # not the
        # exception itself: a handler keeping the record would keep its frames, and their memory, alive
    torch.cuda.empty_cache()
    return solved(*(g.cpu() for g in grams))


def _finite_rows(t: torch.Tensor) -> torch.Tensor:
    """Per leading index, whether a batch of Grams is finite: a Gram's diagonal holds every
    row's squared norm, so a NaN or inf anywhere in Y shows there, and a finite diagonal
    bounds every entry (Cauchy-Schwarz)."""
    return torch.isfinite(t.diagonal(dim1=-2, dim2=-1)).flatten(1).all(1).cpu()


def _zero_rows(t: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return t if bool(ok.all()) else torch.where(ok.to(t.device).view(-1, *[1] * (t.dim() - 1)), t, 0.0)
