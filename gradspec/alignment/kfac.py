"""K-FAC and EK-FAC: a Kronecker-factored curvature per part, fitted on training data, that align
applies to the task's gradients, so the pool is compared with (A ⊗ S)^-1 G_task: influence as
kronfluence and bergson compute it, but exact per sample (no projection of either side).

Per part, over the fitting pass's valid tokens, with the data's own labels (the empirical Fisher):
A = mean_t x_t x_t^T (d_in x d_in) and S = mean_t δ_t δ_t^T (d_out x d_out), δ the output gradient of
the sample's response loss. K-FAC damps each factor by damping x its mean eigenvalue (factored
Tikhonov, Martens & Grosse 2015): the inverse stays a Kronecker product, so it applies to the task's
own rows (x A^-1, δ S^-1) and both of align's routes stay exact. EK-FAC (George et al. 2018) keeps
the factors' eigenvectors and replaces the eigenvalues of A ⊗ S by the per-sample gradients' second
moments in that basis, Λ = mean_i (Q_S^T G_i Q_A)^2 over every fitting example, damped by damping x mean(Λ): no longer a
Kronecker product, so the dense route only. The overall scale of either cancels out of every cosine
and every ranking (the damping is relative).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradspec.alignment.capture import KeptCapture
from gradspec.alignment.directions import masked
from gradspec.choices import DAMPING
from gradspec.layers.hooks import BatchLayout, Captured
from gradspec.layers.registry import Part, Target

KINDS = ("kfac", "ekfac")
_FORMAT = "gradspec-kfac-1"


def _cached(held: dict, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict:
    """tensors copied to (device, dtype) once, then reused."""
    key = (torch.device(device), dtype)
    if key not in held:
        held[key] = {name: t.to(device, dtype) for name, t in tensors.items()}
    return held[key]


def damped_inverse(F: torch.Tensor, damping: float) -> torch.Tensor:
    """(F + damping * mean eigenvalue * I)^-1 of a symmetric PSD factor, fp64: the mean eigenvalue is the
    trace over the size, and the damped factor is positive definite, so a Cholesky inverse (several times
    faster than an eigendecomposition) does."""
    F = F.double()
    damped = F + damping * torch.trace(F) / len(F) * torch.eye(len(F), dtype=F.dtype)
    return torch.cholesky_inverse(torch.linalg.cholesky(damped))


def shared(factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensor object for consecutive parts whose factor is equal (q, k and v read one input, so
    their A is one matrix): decomposed, inverted and stored once."""
    out: dict[str, torch.Tensor] = {}
    previous = None
    for name, t in factors.items():
        if previous is not None and previous.shape == t.shape and torch.equal(previous, t):
            t = previous
        out[name] = previous = t
    return out


@dataclass
class KroneckerInverse:
    """One part's K-FAC inverse: G -> S_d^-1 G A_d^-1, or on the task's rows x -> x A_d^-1, δ -> δ S_d^-1."""

    A_inv: torch.Tensor
    S_inv: torch.Tensor
    _held: dict = field(default_factory=dict, repr=False)

    def _on(self, device, dtype) -> dict:
        return _cached(self._held, {"A": self.A_inv, "S": self.S_inv}, device, dtype)

    def task_rows(self, x: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self._on(x.device, x.dtype)
        return x @ f["A"], d @ f["S"]

    def task_gradient(self, G: torch.Tensor) -> torch.Tensor:
        f = self._on(G.device, G.dtype)
        return f["S"] @ G @ f["A"]


@dataclass
class EigenCorrectedInverse:
    """One part's EK-FAC inverse: G -> Q_S [(Q_S^T G Q_A) / (Λ + λ)] Q_A^T."""

    Q_A: torch.Tensor
    Q_S: torch.Tensor
    denominator: torch.Tensor  # (d_out, d_in): Λ + damping * mean(Λ)
    _held: dict = field(default_factory=dict, repr=False)

    def task_gradient(self, G: torch.Tensor) -> torch.Tensor:
        f = _cached(self._held, {"A": self.Q_A, "S": self.Q_S, "L": self.denominator}, G.device, G.dtype)
        return f["S"] @ ((f["S"].T @ G @ f["A"]) / f["L"]) @ f["A"].T


@dataclass
class KFACFactors:
    """Per part, A and S (fp64, host); with EK-FAC also Λ (d_out, d_in). provenance: what they were
    fitted on (recorded with them and in the score file)."""

    A: dict[str, torch.Tensor]
    S: dict[str, torch.Tensor]
    eigenvalues: dict[str, torch.Tensor] | None = None
    provenance: dict = field(default_factory=dict)
    _decomposed: dict = field(default_factory=dict, repr=False)  # id(factor) -> (factor, values, vectors)

    def __post_init__(self) -> None:
        self.A, self.S = shared(self.A), shared(self.S)

    def eigh(self, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A factor's eigenvalues and eigenvectors (fp64, EK-FAC's basis), once per factor however many parts
        share it."""
        held = self._decomposed.get(id(factor))
        if held is None or held[0] is not factor:
            held = self._decomposed[id(factor)] = (factor, *torch.linalg.eigh(factor.double()))
        return held[1], held[2]

    @property
    def kind(self) -> str:
        return "kfac" if self.eigenvalues is None else "ekfac"

    def bases(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The eigenvectors Q_A, Q_S of a part's factors (fp64)."""
        return self.eigh(self.A[name])[1], self.eigh(self.S[name])[1]

    def inverses(self, damping: float = DAMPING) -> dict[str, KroneckerInverse | EigenCorrectedInverse]:
        """Each part's damped inverse, as align applies it to the task's gradients."""
        if self.eigenvalues is None:
            inverted: dict[int, torch.Tensor] = {}

            def inverse(F: torch.Tensor) -> torch.Tensor:
                if id(F) not in inverted:
                    inverted[id(F)] = damped_inverse(F, damping)
                return inverted[id(F)]

            return {name: KroneckerInverse(inverse(self.A[name]), inverse(self.S[name])) for name in self.A}
        out = {}
        for name in self.A:
            Q_A, Q_S = self.bases(name)
            L = self.eigenvalues[name].double()
            out[name] = EigenCorrectedInverse(Q_A, Q_S, L + damping * L.mean())
        return out

    def to_bytes(self) -> bytes:
        """The factors as safetensors: <part>.A, <part>.S (and <part>.eigenvalues), fp64; a factor several
        parts share once, the others named as its aliases in the metadata (read back by load)."""
        from safetensors.torch import save

        tensors, aliases, first = {}, {}, {}
        named = [(f"{n}.A", t) for n, t in self.A.items()] + [(f"{n}.S", t) for n, t in self.S.items()]
        for key, t in named + [(f"{n}.eigenvalues", t) for n, t in (self.eigenvalues or {}).items()]:
            if id(t) in first:
                aliases[key] = first[id(t)]
            else:
                first[id(t)], tensors[key] = key, t.contiguous()
        return save(tensors, metadata={"format": _FORMAT, "kind": self.kind, "provenance": json.dumps(self.provenance),
                                       "aliases": json.dumps(aliases)})

    @classmethod
    def load(cls, path: str | Path, parts: Sequence[Part]) -> KFACFactors:
        """The factors in path for these parts; a file of another kind, or one missing a part or
        holding it at another shape, is refused naming the file and the part."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
                if meta.get("format") != _FORMAT:
                    raise ValueError(f"{path}: not a factors file gradspec wrote (format {meta.get('format')!r})")
                tensors = {k: f.get_tensor(k) for k in keys}
                tensors |= {k: tensors[v] for k, v in json.loads(meta.get("aliases", "{}")).items() if v in tensors}
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path}: cannot read the K-FAC factors ({error})") from error
        ekfac = meta.get("kind") == "ekfac"
        for p in parts:
            shapes = {"A": (p.d_in, p.d_in), "S": (p.d_out, p.d_out)} | ({"eigenvalues": (p.d_out, p.d_in)}
                                                                         if ekfac else {})
            for what, shape in shapes.items():
                got = tensors.get(f"{p.name}.{what}")
                if got is None or tuple(got.shape) != shape:
                    raise ValueError(f"{path}: no {what} of shape {shape} for {p.name} "
                                     f"({'missing' if got is None else tuple(got.shape)}): factors fitted for "
                                     "another model or other modules; fit them again (another --factors path)")
        names = [p.name for p in parts]
        return cls({n: tensors[f"{n}.A"] for n in names}, {n: tensors[f"{n}.S"] for n in names},
                   {n: tensors[f"{n}.eigenvalues"] for n in names} if ekfac else None,
                   json.loads(meta.get("provenance", "{}")))


# A backward pass over one padded batch with these captures: (captures, batch) -> (loss, count, finite, stats)
Pass = Callable[[list[KeptCapture], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple]


class _Covariances(KeptCapture):
    """Sums of x x^T and δ δ^T over each part's valid tokens, and their count."""

    def __init__(self, targets: list[Target], batch: BatchLayout, sums: dict[str, list]) -> None:
        super().__init__(targets, batch)
        self.sums = sums

    def on_part(self, part: Part, captured: Captured) -> None:
        X = masked(captured.X, captured.mask, torch.float64).flatten(0, 1)
        D = masked(captured.D, captured.mask, torch.float64).flatten(0, 1)
        s = self.sums[part.name]
        s[0] = s[0] + (X.T @ X).cpu()
        s[1] = s[1] + (D.T @ D).cpu()
        s[2] += int(captured.lengths.sum())


class _Eigenvalues(KeptCapture):
    """Sums of (Q_S^T G_i Q_A)^2 over the samples reaching each part (the others' G_i is zero there)."""

    def __init__(self, targets: list[Target], batch: BatchLayout, bases: dict, sums: dict[str, list]) -> None:
        super().__init__(targets, batch)
        self.bases, self.sums = bases, sums

    def on_part(self, part: Part, captured: Captured) -> None:
        Q_A, Q_S = (q.to(captured.X.device) for q in self.bases[part.name])
        X = masked(captured.X, captured.mask, torch.float64) @ Q_A
        D = masked(captured.D, captured.mask, torch.float64) @ Q_S
        self.sums[part.name] = self.sums[part.name] + (D.transpose(1, 2) @ X).pow(2).sum(0).cpu()


def fit_factors(backward_pass: Pass, targets: list[Target], batches: Sequence[tuple[torch.Tensor, ...]],
                kind: str = "kfac", provenance: dict | None = None) -> KFACFactors:
    """The factors of each scored part from right-padded batches of training examples (with response
    tokens): one pass, and a second for EK-FAC's eigenvalues. fp64 throughout."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    parts = [p for t in targets for p in t.parts]
    device = batches[0][0].device if batches else torch.device("cpu")

    def each_batch(capture):
        for batch in batches:
            backward_pass([capture(BatchLayout(batch[1].sum(1).cpu(), device))], batch)

    sums = {p.name: [0.0, 0.0, 0] for p in parts}
    each_batch(lambda layout: _Covariances(targets, layout, sums))
    unseen = [name for name, s in sums.items() if s[2] == 0]
    if unseen:
        raise ValueError(f"no fitting example reached {', '.join(unseen[:5])}{' …' if len(unseen) > 5 else ''}: "
                         "fit on more data (a routed expert no token reached has no curvature to estimate)")
    examples = sum(len(b[0]) for b in batches)
    factors = KFACFactors({n: s[0] / s[2] for n, s in sums.items()}, {n: s[1] / s[2] for n, s in sums.items()},
                          provenance=dict(provenance or {}, examples=examples))
    if kind == "ekfac":
        bases = {name: factors.bases(name) for name in sums}
        second: dict[str, torch.Tensor | float] = {p.name: 0.0 for p in parts}
        each_batch(lambda layout: _Eigenvalues(targets, layout, bases, second))
        factors.eigenvalues = {n: s / examples for n, s in second.items()}
    return factors
