"""MoE experts as transformers 5 stores them: one ``…Experts`` module holding fused 3-D parameters,
gate_up_proj (E, 2I, H) and down_proj (E, H, I) (Qwen3-MoE, Mixtral, OLMoE); stored transposed,
(E, H, 2I) and (E, I, H), with gate and up interleaved and biases (gpt-oss); or up_proj alone. The
layout flags are those of ``transformers.integrations.moe.use_experts_implementation``.

Each expert e gives three parts, the slices [e] of those parameters (roles expert_gate, expert_up,
expert_down), over the tokens routed to it, with the routing weight entering as the model applies it.
During a scored pass the module runs gradspec's forward: transformers' computation over the (token,
expert) pairs sorted by expert, one grouped GEMM per projection (else one GEMM per expert), whose
intermediate tensors carry the hooks.
Each pair is reduced once, for the expert it reached: the cost grows with the routed tokens, not with
E x T. Each (sample, expert) pair's tokens are a segment; a capture that takes stacks gets a role's
segments of a layer as one Stack per length bucket, so its Gram and eigen calls do not grow with E.
The model's own implementation (``experts_implementation``: grouped_mm, batched_mm, eager) is put
back after, and is what the reference differentiates. The pass reads the routed-token counts on the
host once per MoE layer (transformers' eager loop syncs once per expert).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gradspec.layers.checkpointing import FIRST, RECOMPUTE, Pairing
from gradspec.layers.hooks import Captured
from gradspec.layers.linear import start_graph
from gradspec.layers.lora import adapted
from gradspec.layers.registry import Part, Stack, Target, parameter_shape, register
from gradspec.linalg.host_copies import to_device

CAPTURED_AS = "gradspec"  # the implementation a scored pass runs, recorded in score files


class ExpertsTarget(Target):
    """A fused experts module; parts named <module>.<e>.<gate|up|down>."""

    def __init__(self, name: str, module: nn.Module, parts: tuple[Part, ...], num_experts: int) -> None:
        super().__init__(name, module, parts)
        self.num_experts = num_experts
        self.scored_as = adapted(name)[0]  # the model's own name: its parts' and routed-token columns' prefix

    @staticmethod
    def expert_of(part: Part) -> int:
        return part.index[0]

    @property
    def experts_scored(self) -> list[int]:
        """The experts with a part scored, in order: each sample's routed-token count is recorded for these."""
        return sorted({self.expert_of(p) for p in self.parts})

    def describe(self) -> dict:
        config = getattr(self.module, "config", None)
        return {"experts_implementation": {"captured_as": CAPTURED_AS,
                                           "model": getattr(config, "_experts_implementation", None)}}

    def attach(self, batch, deliver: Callable) -> list:
        module = self.module
        # A dispatched model's module (accelerate) runs its own forward as _old_forward, between the hook
        # that brings its weights and inputs to its device and the one that offloads them again.
        slot = "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"
        previous = module.__dict__.get(slot)
        signature = inspect.signature(type(module).forward)
        own = previous if previous is not None else type(module).forward.__get__(module)
        pairing = Pairing()  # calls inside checkpointed regions

        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():  # nothing to capture: the model's own implementation
                return own(*args, **kwargs)
            bound = signature.bind(module, *args, **kwargs)
            hidden, index, weights = list(bound.arguments.values())[1:4]
            return self._forward(batch, deliver, pairing, hidden, index, weights)

        setattr(module, slot, forward)
        return [_Forward(module, slot, previous)]

    def _forward(self, batch, deliver: Callable, pairing: Pairing, hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        m, E = self.module, self.num_experts
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        NT, k, N = hidden.shape[0], top_k_index.shape[-1], batch.N
        owner = batch.token_owner(hidden.device)  # each token's sample; N: padding, in no sample
        if NT != len(owner):
            raise ValueError(f"{self.name}: {NT} tokens, where the batch's input has {len(owner)}")
        # (token, expert) pairs sorted by expert, then sample, then position: each (expert, sample) a run
        # of rows, padding last within its expert. E: a sentinel (expert parallel), never computed.
        pairs = torch.arange(NT, device=hidden.device).repeat_interleave(k)
        group = top_k_index.reshape(-1).clamp(max=E) * (N + 1) + owner[pairs]
        key, order = torch.sort(group * NT + pairs, stable=True)
        token, group = key % NT, key // NT
        weight = top_k_weights.reshape(-1)[order]
        counts = torch.zeros(2, (E + 1) * (N + 1), dtype=torch.int64, device=hidden.device)
        counts[0].index_add_(0, group, torch.ones_like(group))
        counts[1].index_add_(0, group, (group % (N + 1) < N).to(torch.int64))
        total, routed = counts.cpu().view(2, E + 1, N + 1).unbind(0)  # the layer's one host sync
        routed = routed[:, :N]
        ends = total[:E].sum(1).cumsum(0).tolist()
        S = ends[-1] if ends else 0
        X = hidden[token[:S]]
        bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        grouped = _Grouped(ends, group[:S] // (N + 1), X) if _Grouped.runs(X) else None
        gate_up = _per_expert(m, _up_name(m), X, bounds, grouped)
        # Under non-reentrant checkpointing the first run holds no input: its output gradients meet the
        # recompute's inputs (layers/checkpointing.Pairing), the up projection's then the down's, by call.
        now = batch.phase()
        gate_up = start_graph(gate_up)  # in the recompute too: it must save what the first run saved
        if now.kind == RECOMPUTE:
            pairing.recomputed(now.frame, X.detach(), _paired(deliver))
        else:
            layout = _Layout(self, batch, total, routed, S, hidden.device)
            for e in layout.parts:
                batch.routed_tokens[f"{self.scored_as}.{e}"] = routed[e].clone()
            self._on_gradient(gate_up, layout, deliver, "up", X, pairing, now)
        h = m._apply_gate(gate_up) if _up_name(m) == "gate_up_proj" else m.act_fn(gate_up)
        out = _per_expert(m, "down_proj", h, bounds, grouped)
        if now.kind == RECOMPUTE:
            pairing.recomputed(now.frame, h.detach(), _paired(deliver))
        else:
            self._on_gradient(out, layout, deliver, "down", h, pairing, now)
        if getattr(m, "has_post_expert_norm", False):
            out = m.post_expert_norm(out)
        final = torch.zeros_like(hidden).index_add_(0, token[:S], (out * weight[:S, None]).to(hidden.dtype))
        return final.reshape(hidden_states.shape)


    @staticmethod
    def _on_gradient(output: torch.Tensor, layout: _Layout, deliver: Callable, which: str, X: torch.Tensor,
                     pairing: Pairing, now) -> None:
        """Delivers the up or down projection's parts once output's gradient comes: with X held until
        then, or under checkpointing with the recompute's X (this run holds nothing)."""
        if now.kind == FIRST:
            key = pairing.expect(now.frame)
            output.register_hook(lambda grad: pairing.gradient(key, (grad.detach(), layout, which), _paired(deliver)))
        else:
            kept = X.detach()
            output.register_hook(lambda grad: layout.deliver(deliver, which, kept, grad.detach()))


def _paired(deliver: Callable) -> Callable:
    """What Pairing calls with a recomputed X and the first run's (D, layout, which)."""
    return lambda X, gradient: gradient[1].deliver(deliver, gradient[2], X, gradient[0])


class _Segments:
    """A bucket's input, as its Captured's key: dead once every part reading it has been delivered, so
    that an eager capture (under checkpointing) solves its Grams then, as it does a dense input's once
    its tensor is gone (layers.hooks.InputKey), and does not hold every layer's to the end."""

    __slots__ = ("delivered",)

    def __init__(self) -> None:
        self.delivered = False

    def alive(self) -> bool:
        return not self.delivered


class _Bucket(NamedTuple):
    """One length bucket of an experts module's (sample, expert) segments: a Stack per role, and
    where its gather index, batch rows and lengths lie in the layout's device tensor."""

    stacks: tuple[Stack, ...]
    key: _Segments  # its Captured's layout and input
    t: int  # its longest segment
    lengths: torch.Tensor
    rows: tuple[int, ...]
    index: slice
    device_rows: slice
    device_lengths: slice


class _Layout:
    """Where each sample's routed tokens lie among an experts module's sorted pairs, and how they are
    delivered: to captures that take stacks, per role one Stack of (sample, expert) segments per
    length bucket (segments of 2^(b-1) < n <= 2^b tokens: padding under 2x), so that a layer's Gram
    and eigen calls do not grow with its experts; else per expert, the samples that reached it. Gather
    indices into the pairs (S: a zero row) are built on the host and copied to the device once."""

    def __init__(self, target: ExpertsTarget, batch, total: torch.Tensor, routed: torch.Tensor, S: int,
                 device: torch.device) -> None:
        self.target, self.batch, self.S, self.device = target, batch, S, device
        self.parts: dict[int, dict[str, list[Part]]] = {}  # expert -> {"up": gate and up parts, "down": ...}
        for p in target.parts:
            which = "down" if p.role == "expert_down" else "up"
            self.parts.setdefault(target.expert_of(p), {"up": [], "down": []})[which].append(p)
        self.parts = dict(sorted(self.parts.items()))
        self.starts = (total.flatten().cumsum(0) - total.flatten()).view_as(total).numpy()
        self.counts = routed.numpy()
        self._per_expert: tuple | None = None
        self._stacked: dict[str, tuple] = {}

    def deliver(self, deliver: Callable, which: str, X: torch.Tensor, D: torch.Tensor) -> None:
        """The up (gate and up) or down projection's parts: as stacks to the captures that take them
        (deliver.stacked), per expert to the others (deliver.alone; a plain deliver: to every capture)."""
        Xz, Dz = (torch.cat([Y, Y.new_zeros(1, Y.shape[1])]) for Y in (X, D))
        stacked, alone = getattr(deliver, "stacked", None), getattr(deliver, "alone", deliver)
        if stacked is not None:
            self._deliver_stacks(stacked, which, Xz, Dz)
        if alone is not None:
            self._deliver_per_expert(alone, which, Xz, Dz)

    def _gather(self, pieces: list[np.ndarray]) -> torch.Tensor | None:
        return to_device(torch.from_numpy(np.concatenate(pieces)), self.device) if pieces else None

    def _segments(self, experts: list[int]) -> tuple[np.ndarray, ...]:
        """(expert position, sample, token count, first pair) of each reached (expert, sample), by expert."""
        counts = self.counts[experts]
        at, sample = np.nonzero(counts)
        return at, sample, counts[at, sample], self.starts[experts][at, sample]

    def _index(self, start: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, int]:
        """Each segment's pair rows, padded with S to the longest: ((segments x t,), t)."""
        t = int(n.max())
        steps = np.arange(t)
        return np.where(steps < n[:, None], start[:, None] + steps, self.S).ravel(), t

    def _deliver_stacks(self, deliver: Callable, which: str, Xz: torch.Tensor, Dz: torch.Tensor) -> None:
        if which not in self._stacked:
            self._stacked[which] = self._buckets(which)
        buckets, on_device = self._stacked[which]
        for b in buckets:
            index, n = on_device[b.index], len(b.rows)
            Xs, Ds = Xz[index].view(n, b.t, -1), Dz[index].view(n, b.t, -1)
            captured = Captured(Xs, Ds, b.lengths, b.rows, self.batch, b.key, b.key, on_device[b.device_rows],
                                on_device[b.device_lengths])
            for stack in b.stacks:
                deliver(stack, captured.with_D(stack.output_features(Ds)))
            b.key.delivered = True

    def _buckets(self, which: str) -> tuple[list[_Bucket], torch.Tensor | None]:
        """Per group of experts scoring the same roles, per length bucket, its segments; on the device,
        every bucket's gather index, batch rows and lengths in one tensor (one copy)."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for e, parts in self.parts.items():
            if parts[which]:
                groups.setdefault(tuple(p.role for p in parts[which]), []).append(e)
        buckets, pieces, at = [], [], 0

        def place(piece: np.ndarray) -> slice:
            nonlocal at
            pieces.append(piece)
            at += len(piece)
            return slice(at - len(piece), at)

        for roles, experts in groups.items():
            position, sample, n, start = self._segments(experts)
            bucket = np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64)
            for b in np.unique(bucket).tolist():
                sel = np.flatnonzero(bucket == b)
                index, t = self._index(start[sel], n[sel])
                owners = [experts[k] for k in position[sel].tolist()]
                name = f"{self.target.scored_as}.{which}[{'+'.join(roles)}; segments of <={1 << b} tokens]"
                stacks = tuple(Stack.of(f"{name}.{role}", tuple(self.parts[e][which][r] for e in owners))
                               for r, role in enumerate(roles))
                buckets.append(_Bucket(stacks, _Segments(), t, torch.from_numpy(n[sel]),
                                       tuple(sample[sel].tolist()), place(index), place(sample[sel]), place(n[sel])))
        return buckets, self._gather(pieces)

    def _deliver_per_expert(self, deliver: Callable, which: str, Xz: torch.Tensor, Dz: torch.Tensor) -> None:
        if self._per_expert is None:
            self._per_expert = self._experts()
        experts, (index, device_lengths, device_rows) = self._per_expert
        at = row = 0
        for e, reached, lengths, n, t in experts:
            parts = self.parts[e][which]
            if parts:
                rows = index[at : at + n * t]
                Xe, De = Xz[rows].view(n, t, -1), Dz[rows].view(n, t, -1)
                captured = Captured(Xe, De, lengths, reached, self.batch, (self.target.name, e),
                                    (self.target.name, e, which), device_rows[row : row + n],
                                    device_lengths[row : row + n])
                for part in parts:
                    deliver(part, captured.with_D(part.output_features(De)))
            at, row = at + n * t, row + n

    def _experts(self) -> tuple[list, tuple]:
        """Per reached expert (expert, samples, their counts, n, t), and on the device the gather index,
        counts and samples of all of them."""
        experts, pieces, lengths, rows = [], [], [], []
        for e in self.parts:
            _, sample, n, start = self._segments([e])
            if not len(n):
                continue
            index, t = self._index(start, n)
            experts.append((e, tuple(sample.tolist()), torch.from_numpy(n), len(n), t))
            pieces.append(index)
            lengths.append(n)
            rows.append(sample)
        return experts, (self._gather(pieces), self._gather(lengths), self._gather(rows))


def _up_name(module: nn.Module) -> str:
    return "gate_up_proj" if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) else "up_proj"


class _Grouped:
    """One grouped GEMM for all experts (torch's grouped_mm, as transformers' grouped_mm implementation
    runs): a call and a launch per projection, not per expert, the same numbers as one GEMM per expert
    (tests/layers/test_experts_stacked.py). Where torch has no grouped_mm kernel for the tensor (fp64,
    older GPUs) or autocast would cast each expert's GEMM, one GEMM per expert."""

    def __init__(self, ends: list[int], experts: torch.Tensor, X: torch.Tensor) -> None:
        self.offsets = to_device(torch.tensor(ends, dtype=torch.int32), X.device)  # each expert's last row + 1
        self.experts = experts  # each row's expert (for the biases)

    @staticmethod
    def runs(X: torch.Tensor) -> bool:
        if getattr(F, "grouped_mm", None) is None or X.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if torch.is_autocast_enabled(X.device.type):
            return False
        return X.device.type == "cpu" or (X.device.type == "cuda"
                                          and torch.cuda.get_device_capability(X.device) >= (8, 0))

    def __call__(self, X: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
        out = F.grouped_mm(X.to(W.dtype), W if transposed else W.transpose(-2, -1), offs=self.offsets)
        return out if bias is None else out + bias[self.experts]


def _per_expert(module: nn.Module, name: str, X: torch.Tensor, bounds: list[tuple[int, int]],
                grouped: _Grouped | None) -> torch.Tensor:
    """Each expert's rows of X through its slice of the parameter `name` (and its bias): one grouped
    GEMM, else one GEMM per expert."""
    W, bias = getattr(module, name), getattr(module, f"{name}_bias", None)
    transposed = getattr(module, "is_transposed", False)
    if grouped is not None:
        return grouped(X, W, bias, transposed)
    # split, not slices: a slice's backward fills a zero gradient of all of X's rows (E x S x H in all)
    rows = X.split([b - a for a, b in bounds])
    pieces = [(rows[e] @ W[e] if transposed else F.linear(rows[e], W[e])) + (0 if bias is None else bias[e])
              for e, (a, b) in enumerate(bounds) if b > a]
    width = W.shape[2] if transposed else W.shape[1]
    return torch.cat(pieces) if pieces else X.new_zeros(0, width)


class _Forward:
    """Puts a module's own forward back (a handle, like a hook's)."""

    def __init__(self, module: nn.Module, slot: str, previous) -> None:
        self.module, self.slot, self.previous = module, slot, previous

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop(self.slot, None)
        else:
            setattr(self.module, self.slot, self.previous)


@register
def experts(model: nn.Module, name: str, module: nn.Module) -> ExpertsTarget | None:
    up, down = getattr(module, _up_name(module), None), getattr(module, "down_proj", None)
    if not (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return None
    shape = parameter_shape(model, module, _up_name(module))  # FSDP1 keeps a flat shard on the module
    if len(shape) != 3 or len(parameter_shape(model, module, "down_proj")) != 3:
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    E, width, hidden = (shape[0], shape[2], shape[1]) if transposed else shape
    gated = _up_name(module) == "gate_up_proj"
    inner = width // 2 if gated else width
    if gated:
        concatenated = getattr(module, "is_concatenated", True)
        features = {"gate": (0, inner, 1) if concatenated else (0, width, 2),
                    "up": (inner, width, 1) if concatenated else (1, width, 2)}
    else:
        features = {"up": (0, width, 1)}
    parts, scored_as = [], adapted(name)[0]  # (ExpertsTarget.scored_as)
    for e in range(E):
        for role, cut in features.items():
            index = (e, slice(None), slice(*cut)) if transposed else (e, slice(*cut))
            parts.append(Part(f"{scored_as}.{e}.{role}_proj", f"expert_{role}", hidden, inner,
                              f"{name}.{_up_name(module)}", index, transposed, cut, routed=True))
        parts.append(Part(f"{scored_as}.{e}.down_proj", "expert_down", inner, hidden, f"{name}.down_proj", (e,),
                          transposed, routed=True))
    return ExpertsTarget(name, module, tuple(parts), E)
