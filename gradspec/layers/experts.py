"""MoE experts as transformers 5 stores them: one ``…Experts`` module holding fused 3-D parameters,
gate_up_proj (E, 2I, H) and down_proj (E, H, I) (Qwen3-MoE, Mixtral, OLMoE); stored transposed,
(E, H, 2I) and (E, I, H), with gate and up interleaved and biases (gpt-oss); or up_proj alone. The
layout flags are those of ``transformers.integrations.moe.use_experts_implementation``.

Each expert e gives three parts, the slices [e] of those parameters (roles expert_gate, expert_up,
expert_down), over the tokens routed to it, with the routing weight entering as the model applies it.
During a scored pass the module runs gradspec's forward: transformers' eager computation, one GEMM per
expert over the (token, expert) pairs sorted by expert, whose intermediate tensors carry the hooks.
Each pair is reduced once, for the expert it reached: the cost grows with the routed tokens, not with
E x T. The model's own implementation (``experts_implementation``: grouped_mm, batched_mm, eager) is
put back after, and is what the reference differentiates. The pass reads the routed-token counts on
the host once per MoE layer (transformers' eager loop syncs once per expert).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gradspec.layers.checkpointing import FIRST, RECOMPUTE, Pairing
from gradspec.layers.hooks import Captured
from gradspec.layers.linear import start_graph
from gradspec.layers.lora import adapted
from gradspec.layers.registry import Part, Target, parameter_shape, register
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
        gate_up = _per_expert(m, _up_name(m), X, bounds)
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
        out = _per_expert(m, "down_proj", h, bounds)
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


class _Layout:
    """Where each sample's routed tokens lie among an experts module's sorted pairs: per expert, the
    samples that reached it (those with tokens within their length), their counts, and a gather index
    (n_e, t_e) into the pairs (S: a zero row), built on the host and copied to the device once."""

    def __init__(self, target: ExpertsTarget, batch, total: torch.Tensor, routed: torch.Tensor, S: int,
                 device: torch.device) -> None:
        self.target, self.batch, self.S = target, batch, S
        self.parts: dict[int, dict[str, list[Part]]] = {}  # expert -> {"up": gate and up parts, "down": ...}
        for p in target.parts:
            which = "down" if p.role == "expert_down" else "up"
            self.parts.setdefault(target.expert_of(p), {"up": [], "down": []})[which].append(p)
        self.parts = dict(sorted(self.parts.items()))
        starts = (total.flatten().cumsum(0) - total.flatten()).view_as(total).numpy()
        counts = routed.numpy()
        self.experts, pieces, lengths, rows = [], [], [], []
        for e in self.parts:
            reached = np.flatnonzero(counts[e])
            if not len(reached):
                continue
            n = counts[e, reached]
            steps = np.arange(n.max())
            pieces.append(np.where(steps < n[:, None], starts[e, reached][:, None] + steps, S).ravel())
            self.experts.append((e, tuple(reached.tolist()), torch.from_numpy(n), len(reached), int(n.max())))
            lengths.append(n)
            rows.append(reached)
        cat = (lambda arrays: to_device(torch.from_numpy(np.concatenate(arrays)), device)) \
            if pieces else (lambda arrays: None)
        self.index, self.device_lengths, self.device_rows = cat(pieces), cat(lengths), cat(rows)

    def deliver(self, deliver: Callable, which: str, X: torch.Tensor, D: torch.Tensor) -> None:
        """Each reached expert's parts of the up (gate and up) or down projection."""
        Xz, Dz = (torch.cat([Y, Y.new_zeros(1, Y.shape[1])]) for Y in (X, D))
        at = row = 0
        for e, reached, lengths, n, t in self.experts:
            index = self.index[at : at + n * t]
            parts = self.parts[e][which]
            if parts:
                Xe, De = Xz[index].view(n, t, -1), Dz[index].view(n, t, -1)
                captured = Captured(Xe, De, lengths, reached, self.batch, (self.target.name, e),
                                    (self.target.name, e, which), self.device_rows[row : row + n],
                                    self.device_lengths[row : row + n])
                for part in parts:
                    deliver(part, captured.with_D(part.output_features(De)))
            at, row = at + n * t, row + n


def _up_name(module: nn.Module) -> str:
    return "gate_up_proj" if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) else "up_proj"


def _per_expert(module: nn.Module, name: str, X: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Each expert's rows of X through its slice of the parameter `name` (and its bias): one GEMM per expert."""
    W, bias = getattr(module, name), getattr(module, f"{name}_bias", None)
    transposed = getattr(module, "is_transposed", False)
    pieces = [(X[a:b] @ W[e] if transposed else F.linear(X[a:b], W[e])) + (0 if bias is None else bias[e])
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
