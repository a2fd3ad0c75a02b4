"""Hook state for one batch: each scored module's input X in the forward, its per-sample Grams
(or materialised G) as its output gradient D arrives in the backward, and the eigen stage that
turns them into spectra and metrics (reduce).

Which samples take the core path (T x T problem from X X^T and D D^T) and which the materialised
one (the Gram of G = D^T X), and how many tokens each reduction spans, are decided from the lengths
on the host once per batch: the hooks never wait for the device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from gradspec.kernels import token_mask
from gradspec.layers.targets import Part, Target
from gradspec.linalg.eigen import core_spectra, eigen_faults, eigen_path, gram_spectra
from gradspec.linalg.grams import segment_gram
from gradspec.linalg.host_copies import HostCopies
from gradspec.linalg.lowrank import lowrank_metrics, sketch_matrix, sketch_singular_values
from gradspec.linalg.metrics import METRICS
from gradspec.linalg.policy import Policy

log = logging.getLogger("gradspec")
# ||G||_F^2 from the spectrum vs <D D^T, X X^T>: 1e-3 relative, or 1e5 epsilons of the Grams' precision
FROBENIUS_CHECK_RTOL = 1e-3


class LowRankSketch:
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


class PartHooks:
    """Hooks for one batch: each target's input X is kept in the forward, and on_part(part, X, D)
    is called per scored part (D: the part's slice of the output gradient) as the gradient arrives."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = targets
        self.inputs: dict[str, torch.Tensor] = {}

    @contextmanager
    def hooks(self, model: nn.Module) -> Iterator[None]:
        handles = [t.module.register_forward_hook(self._forward_hook(t)) for t in self.targets]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _forward_hook(self, target: Target):
        def hook(module, args, output):
            self.inputs[target.name] = args[0].detach()
            output = start_graph(output)
            output.register_hook(lambda grad: self._on_grad(target, grad.detach()))
            return output

        return hook

    def _on_grad(self, target: Target, grad: torch.Tensor) -> None:
        # Reduced as soon as the gradient arrives; the input is released here (its storage goes
        # once every module reading it is done), so only what on_part keeps stays in flight.
        X = self.inputs.pop(target.name)
        for part in target.parts:
            self.on_part(part, X, grad[..., part.start : part.start + part.d_out])

    def on_part(self, part: Part, X: torch.Tensor, D: torch.Tensor) -> None:
        raise NotImplementedError


@dataclass
class _Samples:
    """Some samples of a batch: their rows on the host, and a gather index on the device (None
    when they are the whole batch: a slice, no copy); T is the longest of them."""

    rows: tuple[int, ...]
    index: torch.Tensor | None
    T: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.index is None else t[self.index]


class BatchCapture(PartHooks):
    """Hook state for one batch: inputs in the forward, reductions as gradients arrive.

    Which samples take the core path, and how many tokens each reduction spans, are decided from
    the lengths on the host, once per batch: the hooks never wait for the device. scale
    multiplies each sample's output gradient (e.g. from a training loss's share back to the
    sample's own mean loss)."""

    def __init__(
        self, targets: list[Target], lengths: torch.Tensor, policy: Policy | str, sketch: LowRankSketch | None,
        metric_names: tuple[str, ...], scale: torch.Tensor | None = None, device: torch.device | str | None = None,
    ) -> None:
        super().__init__(targets)
        self.policy = Policy.of(policy)
        self.metric_names = metric_names
        self.device = torch.device(device) if device is not None else lengths.device
        self.lengths = lengths.cpu().to(torch.int64)
        self.device_lengths = self.lengths.to(self.device, non_blocking=True)
        self.scale = None if scale is None else scale.to(self.device).view(-1, 1, 1)
        self.sketch = sketch
        self.sketched: list[tuple[Part, torch.Tensor, torch.Tensor]] = []  # (part, top-k sigma, ||G||_F^2)
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

    def on_part(self, part: Part, X: torch.Tensor, D: torch.Tensor) -> None:
        if self.scale is not None:
            D = D * self.scale.to(D.dtype)
        if self.sketch is not None:
            s = self.sketch
            omega = s.omega(part, part.d_in, X.device)
            self.sketched.append((part, *sketch_singular_values(
                X, D, self.device_lengths, omega, s.rank, s.power_iters, self.policy)))
            return
        core, materialised = self._split(min(part.d_in, part.d_out))
        if core.rows:
            key = (_input_key(X), core.rows, core.T)
            if key not in self.core:
                self.core[key] = (self._x_gram(X, core, part.d_in), [])
            B, items = self.core[key]
            A, inner = segment_gram(core.take(D)[:, :core.T], core.take(self.device_lengths), B, self.policy)
            items.append((part, A, inner))
        if materialised.rows:
            dtype, lengths = self.policy.dtype, materialised.take(self.device_lengths)
            Xs = materialised.take(X).to(dtype) * token_mask(lengths, X.shape[1], X.device)[..., None]
            G = materialised.take(D).to(dtype).transpose(1, 2) @ Xs  # (n, d_out, d_in)
            gram = G @ G.transpose(1, 2) if part.d_out <= part.d_in else G.transpose(1, 2) @ G
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

        def copier_for(grams: torch.Tensor, stage: str):
            """Copies to the host where this stage's eigen path runs there; else leaves tensors be."""
            path = eigen_path(grams, self.policy, stage)
            paths.add(path)
            return copies if path == "cpp" else (lambda t: t)

        core = {}
        for key, (B, items) in self.core.items():
            move = copier_for(B, "core")  # B and its A's are solved together, on one path
            core[key] = (move(B), [(part, move(A), copies(inner)) for part, A, inner in items])
        self.core = core
        self.materialised = [(part, samples, copier_for(gram, "gram")(gram))
                             for part, samples, gram in self.materialised]
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


def start_graph(output: torch.Tensor) -> torch.Tensor:
    """A scored module's output as the start of the backward's graph where nothing below it needs
    a gradient (parameters are frozen): the backward stops at the lowest scored module instead of
    running down to the embeddings, so scoring the last k of L layers costs about k/L of a backward.
    Its output gradient is unchanged: it depends only on what comes after."""
    return output if output.requires_grad else output.detach().requires_grad_(True)

