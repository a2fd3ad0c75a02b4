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
import logging
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradspec.alignment.batches import numbered
from gradspec.alignment.directions import masked
from gradspec.alignment.kept_capture import KeptCapture
from gradspec.choices import DAMPING
from gradspec.errors import OptionInputError
from gradspec.files import NotRegularFile, checksum_path, checksum_problem, create_new, regular, write_checksum
from gradspec.layers.hooks import BatchLayout, Captured
from gradspec.layers.registry import Part, Target
from gradspec.options import OptionError, mention

KINDS = {"kfac": "K-FAC", "ekfac": "EK-FAC"}  # each kind, by its name in print
_FORMAT = "gradspec-kfac-1"
DTYPES = (torch.float32, torch.float64)  # what a factors file may hold; gradspec writes float64
SYMMETRY = 1e-6  # the most a factor may differ from its transpose, relative to its largest entry
REFIT = f"fit them again (another {mention('factors')} path)"
log = logging.getLogger("gradspec")


def _cached(held: dict, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict:
    """tensors copied to (device, dtype) once, then reused."""
    key = (torch.device(device), dtype)
    if key not in held:
        held[key] = {name: t.to(device, dtype) for name, t in tensors.items()}
    return held[key]


def damped_inverse(F: torch.Tensor, damping: float) -> torch.Tensor | None:
    """(F + damping * mean eigenvalue * I)^-1 of a symmetric PSD factor, fp64: the mean eigenvalue is the
    trace over the size, and the damped factor is positive definite, so a Cholesky inverse (several times
    faster than an eigendecomposition) does. None where the damped factor is not positive definite after
    all (the Cholesky fails, or gives values that are not finite)."""
    F = F.double()
    damped = F + damping * torch.trace(F) / len(F) * torch.eye(len(F), dtype=F.dtype)
    lower, info = torch.linalg.cholesky_ex(damped)
    if info or not torch.isfinite(lower).all():
        return None
    return torch.cholesky_inverse(lower)


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
    """Per part, A and S (fp64, host; float32 where a file holds them so); with EK-FAC also Λ (d_out, d_in).
    provenance: what they were fitted on (recorded with them and in the score file). source: the file they
    were read from (named in errors), None for factors fitted here."""

    A: dict[str, torch.Tensor]
    S: dict[str, torch.Tensor]
    eigenvalues: dict[str, torch.Tensor] | None = None
    provenance: dict = field(default_factory=dict)
    source: str | None = None
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
        """Each part's damped inverse, as align applies it to the task's gradients; a factor (or EK-FAC's
        eigenvalues) that is not positive definite even damped is refused, naming its key and the damping."""
        if self.eigenvalues is None:
            inverted: dict[int, torch.Tensor] = {}

            def inverse(key: str, F: torch.Tensor) -> torch.Tensor:
                if id(F) not in inverted:
                    found = damped_inverse(F, damping)
                    if found is None:
                        raise self._not_definite(key, damping)
                    inverted[id(F)] = found
                return inverted[id(F)]

            return {name: KroneckerInverse(inverse(f"{name}.A", self.A[name]), inverse(f"{name}.S", self.S[name]))
                    for name in self.A}
        out = {}
        for name in self.A:
            Q_A, Q_S = self.bases(name)
            L = self.eigenvalues[name].double()
            denominator = L + damping * L.mean()
            if not (torch.isfinite(denominator).all() and (denominator > 0).all()):
                raise self._not_definite(f"{name}.eigenvalues", damping)
            out[name] = EigenCorrectedInverse(Q_A, Q_S, denominator)
        return out

    def _not_definite(self, key: str, damping: float) -> OptionError:
        if self.source is None:
            return OptionError("damping", f"{damping:g}: the fitted {key} is not positive definite even damped: raise "
                               f"{mention('damping')}, or fit on other data")
        return OptionInputError("factors", f"{self.source}: {key}: not positive definite even damped "
                                f"({mention('damping')} {damping:g}): raise {mention('damping')}, or {REFIT}")

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

    def save(self, path: str | Path) -> bool:
        """The factors written to path (to_bytes) with their checksum beside it (<path>.sha256, which load
        checks), only where nothing is there yet: an existing file is never replaced. Whether this call
        wrote it."""
        if not create_new(path, self.to_bytes()):
            return False
        write_checksum(path)
        return True

    @classmethod
    def load(cls, path: str | Path, parts: Sequence[Part]) -> KFACFactors:
        """The factors in path for these parts, each checked as align will use it. Refused
        (OptionInputError, one line naming the file and the field or tensor): a file that is not safetensors
        or whose bytes differ from those its checksum beside it (<path>.sha256, written by save) records;
        of another format or kind; metadata that is not the JSON objects save writes; a part missing or at
        another shape; a tensor not float32 or float64, not finite, not symmetric (within SYMMETRY of its
        largest entry), with a negative diagonal (or, EK-FAC, a negative eigenvalue). A file without a
        checksum beside it (an earlier gradspec's, or another tool's) is read with a warning, not refused."""
        tensors, meta = _read(path)
        kind = meta.get("kind", "kfac")
        if kind not in KINDS:
            raise _refused(path, f"metadata 'kind': {reprlib.repr(kind)}, not one of {', '.join(KINDS)}")
        provenance = _metadata_object(path, meta, "provenance")
        for alias, key in _metadata_object(path, meta, "aliases").items():
            if alias in tensors or not isinstance(key, str) or key not in tensors:
                why = "is a tensor of the file itself" if alias in tensors else \
                    f"-> {reprlib.repr(key)}, not a tensor of the file"
                raise _refused(path, f"metadata 'aliases': {reprlib.repr(alias)} {why}: damaged or not gradspec's; "
                               f"{REFIT}")
            tensors[alias] = tensors[key]
        ekfac = kind == "ekfac"
        checked: set[int] = set()
        for p in parts:
            shapes = {"A": (p.d_in, p.d_in), "S": (p.d_out, p.d_out)} | ({"eigenvalues": (p.d_out, p.d_in)}
                                                                         if ekfac else {})
            for what, shape in shapes.items():
                got = tensors.get(f"{p.name}.{what}")
                if got is None or tuple(got.shape) != shape:
                    raise _refused(path, f"no {what} of shape {shape} for {p.name} "
                                   f"({'missing' if got is None else tuple(got.shape)}): factors fitted for "
                                   f"another model or other modules; {REFIT}")
                if id(got) not in checked:
                    _check_tensor(path, f"{p.name}.{what}", got)
                    checked.add(id(got))
        names = [p.name for p in parts]
        return cls({n: tensors[f"{n}.A"] for n in names}, {n: tensors[f"{n}.S"] for n in names},
                   {n: tensors[f"{n}.eigenvalues"] for n in names} if ekfac else None, provenance, str(path))


def _refused(path: str | Path, text: str) -> OptionInputError:
    return OptionInputError("factors", f"{path}: {text}")


def _read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A factors file's tensors and metadata, its bytes checked against the checksum beside it where there is
    one (a warning where there is none)."""
    from safetensors import SafetensorError, safe_open

    try:
        regular(path, "a K-FAC factors file (.safetensors)")
        if not checksum_path(path).exists():
            log.warning("%s: no checksum beside it (%s): read unchecked (an earlier gradspec or another tool wrote "
                        "it)", path, checksum_path(path).name)
        else:
            problem = checksum_problem(path)
            if problem is not None:
                raise _refused(path, f"{problem}; {REFIT}")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT:
                raise _refused(path, f"not a factors file gradspec wrote (format {reprlib.repr(meta.get('format'))})")
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except NotRegularFile as error:
        raise _refused(path, str(error).partition(": ")[2]) from None
    except (SafetensorError, OSError) as error:
        raise _refused(path, f"cannot read the K-FAC factors ({' '.join(str(error).split())})") from error


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _metadata_object(path: str | Path, meta: dict[str, str], name: str) -> dict[str, Any]:
    """A metadata field of a factors file, a JSON object as save writes it ({} where the field is absent)."""
    try:
        value = json.loads(meta.get(name, "{}"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise _refused(path, f"metadata {name!r}: not valid JSON ({' '.join(str(error).split())})") from None
    if not isinstance(value, dict):
        raise _refused(path, f"metadata {name!r}: expected a JSON object, got {type(value).__name__} "
                       f"{reprlib.repr(value)}")
    return value


def _check_tensor(path: str | Path, key: str, t: torch.Tensor) -> None:
    """One factor (or EK-FAC's eigenvalues, key *.eigenvalues) as align can use it: float, finite,
    symmetric and with a non-negative diagonal (eigenvalues: non-negative)."""
    if t.dtype not in DTYPES:
        raise _refused(path, f"{key}: {str(t.dtype).removeprefix('torch.')}, not float32 or float64 (gradspec "
                       f"writes float64): {REFIT}, or write its tensors as float64")
    problem = None
    if not torch.isfinite(t).all():
        problem = "holds NaN or infinite values"
    elif key.endswith(".eigenvalues"):
        problem = "a negative eigenvalue (second moments are never negative)" if (t < 0).any() else None
    else:
        scale, asymmetry = float(t.abs().max()), float((t - t.T).abs().max())
        if asymmetry > SYMMETRY * scale:
            problem = (f"not symmetric (it differs from its transpose by up to {asymmetry:.3g}, beyond {SYMMETRY:g} "
                       f"of its largest entry, {scale:.3g})")
        elif (t.diagonal() < 0).any():
            problem = "not positive semi-definite (a negative diagonal entry)"
    if problem is not None:
        raise _refused(path, f"{key}: {problem}: damaged or not gradspec's; {REFIT}")


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
                kind: str = "kfac", provenance: dict | None = None, progress: bool = False) -> KFACFactors:
    """The factors of each scored part from right-padded batches of training examples (with response
    tokens): one pass, and a second for EK-FAC's eigenvalues. fp64 throughout. progress: a bar per pass."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    parts = [p for t in targets for p in t.parts]
    device = batches[0][0].device if batches else torch.device("cpu")

    def each_batch(capture, desc: str):
        for _, batch in numbered(batches, desc, progress):
            backward_pass([capture(BatchLayout(batch[1].sum(1).cpu(), device))], batch)

    sums = {p.name: [0.0, 0.0, 0] for p in parts}
    each_batch(lambda layout: _Covariances(targets, layout, sums), f"fitting {KINDS[kind]} factors")
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
        each_batch(lambda layout: _Eigenvalues(targets, layout, bases, second), "EK-FAC eigenvalues")
        factors.eigenvalues = {n: s / examples for n, s in second.items()}
    return factors
