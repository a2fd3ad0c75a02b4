"""Scoring an MoE model's experts and routers against its own floor, on a random-init Qwen3-MoE of
realistic shape ratios (Qwen3-30B-A3B's scaled down: hidden 2048 -> 256, expert width 768 -> 96,
128 experts top-8 -> 64 top-4, so each token reaches the same 1/16 of the experts), 4 layers.

Rows, on the same padded batches (8 samples of 96-256 tokens, the second half the response):

- floor: one forward and one input-gradient backward, no captures, with the model's own experts
  implementation (grouped_mm) and the LM head at response positions (the engine's own loss); the
  backward starts at the lowest scored modules' outputs (layer 0's q, k, v), as in the engine;
- floor, eager experts: the same under transformers' per-expert loop, the computation gradspec's
  captured forward runs;
- gradspec attn: ``SpectralEngine.score`` of q, k, v, o only (its experts run the model's own way);
- gradspec all: q, k, v, o, every expert's gate, up and down, and the routers.

ROUNDS interleaved rounds after a warm-up; medians and their ratios to the floor are printed, then
where the time of one 'all' pass goes (``stages``: one more pass under cProfile, whose overhead
inflates the Python-heavy stages; each stage's share is of that pass). Run with
``pytest benchmarks/throughput/bench_moe.py -s`` (under a minute on 2 cores); ratios only within one run.
"""

import cProfile
import pstats
import statistics

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.common import interleaved_rounds, score_floor
from gradspec.data.batching import pad_batch
from gradspec.data.templates import IGNORE_INDEX, Tokenized
from gradspec.engine.spectral_engine import SpectralEngine

ROUNDS = 5
LENGTHS = [96, 120, 144, 168, 192, 216, 240, 256]


def moe_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=96,
                            num_experts=64, num_experts_per_tok=4, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(config).eval().requires_grad_(False)


def batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(3, 4096, (n,), generator=g).tolist()
        samples.append(Tokenized(ids, [IGNORE_INDEX] * (n // 2) + ids[n // 2 :], "ok"))
    return pad_batch(samples, 0, "cpu")


def eager_floor(model: torch.nn.Module, padded: tuple[torch.Tensor, ...]) -> None:
    model.set_experts_implementation("eager")
    try:
        score_floor(model, [padded])
    finally:
        model.set_experts_implementation("grouped_mm")


# Stages of one pass, as the functions that run them (cumulative seconds; the hooks' run within the backward).
STAGES = {
    "forward (model, with gradspec's experts forward)": ("loss.py", "response_losses"),
    "backward, all of it": ("autograd/__init__.py", "backward"),
    "  of which the hooks: gathers, Grams (layers.hooks deliver)": ("hooks.py", "deliver"),
    "  of which the Grams themselves (segment_gram)": ("grams.py", "segment_gram"),
    "  of which the Grams of G (product_gram: samples >= the smaller side)": ("grams.py", "product_gram"),
    "eigen stage and metrics (BatchCapture.reduce)": ("capture.py", "reduce"),
}


def stages(run) -> dict[str, float]:
    """Cumulative seconds per STAGES entry of one run under cProfile, and the run's total."""
    profile = cProfile.Profile()
    profile.runcall(run)
    stats = pstats.Stats(profile).stats
    out = {}
    for name, (where, function) in STAGES.items():
        out[name] = sum(ct for (file, _, func), (_, _, _, ct, callers) in stats.items()
                        if file.endswith(where) and func == function  # outermost calls only:
                        and not any((f, fn) == (file, func) for f, _, fn in callers))
    out["total"] = max(ct for (_, _, _, ct, _) in stats.values())
    return out


def test_experts_and_routers_vs_floor():
    model, padded = moe_model(), batch()
    attn, every = SpectralEngine(model, "attn"), SpectralEngine(model, "all")
    rows = {"floor": lambda: score_floor(model, [padded]), "floor, eager experts": lambda: eager_floor(model, padded),
            "gradspec attn": lambda: attn.score(*padded), "gradspec all": lambda: every.score(*padded)}
    for row in rows.values():
        row()  # warm-up: allocator, the extension's thread pool
    times = interleaved_rounds(rows, ROUNDS, "Qwen3-MoE, ")
    med = {row: statistics.median(t) for row, t in times.items()}
    print(f"\nQwen3-MoE (4 layers, 64 experts top-4, hidden 256, expert width 96), {len(LENGTHS)} samples of "
          f"{min(LENGTHS)}-{max(LENGTHS)} tokens; {len(every.parts)} parts scored by 'all'; median of {ROUNDS} rounds")
    for row, m in med.items():
        print(f"  {row:22s} {m:7.3f} s  {m / med['floor']:5.2f}x the floor  "
              f"(rounds: {', '.join(f'{t:.3f}' for t in times[row])})")
    split = {"floor": stages(rows["floor"]), "gradspec all": stages(rows["gradspec all"])}
    print("\nWhere one pass's time goes (seconds under cProfile; its overhead inflates Python-heavy stages):")
    print(f"  {'stage':62s} {'floor':>8s} {'all':>8s}")
    for stage in [*STAGES, "total"]:
        print(f"  {stage:62s} {split['floor'][stage]:8.3f} {split['gradspec all'][stage]:8.3f}")
