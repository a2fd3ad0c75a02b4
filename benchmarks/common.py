"""What the benchmarks share, once: the rounds that compare rows under the same load, the model shapes,
the HumanEval batches, one floor per kind of work, and one peak-RSS measure.

Only the standard library at import: the processes whose peak RSS is measured (bench_store's phases,
a wrapped command) import this module too, so torch and gradspec are imported where a function needs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gradspec.data.batching import Item

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, with this checkout first on PYTHONPATH (so a child process imports this
    checkout's gradspec and benchmarks, whatever is installed) and extra set."""
    import os

    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}

# Medians of the benchmarks run so far in this process, for ratios between them (conftest's record fills it).
MEDIANS: dict[str, float] = {}


def interleaved_rounds(rows: dict[str, Callable[[], object]], rounds: int, label: str = "") -> dict[str, list[float]]:
    """Seconds per round of each row (a callable); each round runs every row once, starting at
    another row, so rows compared share the machine's load of the moment."""
    times: dict[str, list[float]] = {row: [] for row in rows}
    names = list(rows)
    for r in range(rounds):
        for row in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            rows[row]()
            times[row].append(time.perf_counter() - start)
        print(f"\n{label}round {r + 1}/{rounds}: " + ", ".join(f"{row} {t[r]:.2f} s" for row, t in times.items()))
    return times


# Real shapes of three dense models (from their published configs): the GPU suite, its acceptance run and
# the cost model build random-init models of them (no downloads).
SHAPES = {
    "SmolLM2-135M": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)),
    "Qwen2.5-1.5B": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)),
    "Llama-3-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
}


def build_model(kind: str, shape: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init model of one of SHAPES' kinds ("llama", "qwen2"), in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_cls(**shape, max_position_embeddings=4096)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    return model.eval()


def humaneval_items(tok, samples: Sequence, max_length: int = 2048) -> list[Item]:
    """Samples (gradspec.data.readers.humaneval_samples) tokenized as score tokenizes them (plain template)."""
    from gradspec.data.batching import Item
    from gradspec.data.templates import tokenize

    return [Item(s, tokenize(s.messages, tok, "plain", max_length)) for s in samples]


def padded_batches(tok, items: Sequence[Item], tokens: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """The padded (ids, mask, labels) batches score makes of items (token_batches: at most ``tokens`` padded
    tokens, default the GPU's BATCH_TOKENS, at most 20% padding); tokens=0: one sample per batch."""
    from gradspec.data.batching import BATCH_TOKENS, pad_batch, token_batches

    groups = [[i] for i in items] if tokens == 0 else token_batches(list(items), tokens or BATCH_TOKENS)
    return [pad_batch([i.tokens for i in group], tok.pad_token_id, "cpu") for group in groups]


def humaneval_batches(tok, samples: Sequence, tokens: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """padded_batches of humaneval_items: the batches most CPU benchmarks time."""
    return padded_batches(tok, humaneval_items(tok, samples), tokens)


def score_floor(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, ...]], modules: str = "attn") -> None:
    """The floor of scoring: forward and input-gradient backward of each batch, as the engine runs them for
    these modules, without its captures. The loss is the engine's (the LM head at response positions only,
    gradspec.engine.loss.response_losses) and the backward runs from it down to the lowest scored module
    and stops there (start_graph at the scored modules' outputs)."""
    from gradspec.engine.loss import response_losses
    from gradspec.layers.linear import start_graph
    from gradspec.layers.targets import select_targets

    hooks = [t.module.register_forward_hook(lambda module, args, out: start_graph(out))
             for t in select_targets(model, modules)]
    try:
        for ids, mask, labels in batches:
            loss, count, _ = response_losses(model, ids, mask, labels)
            loss[count > 0].sum().backward()
    finally:
        for hook in hooks:
            hook.remove()


def retrain_floor(pool_path: Path, target_path: Path, *, subsets: int, max_length: int, learning_rate: float,
                  batch_size: int = 4) -> None:
    """The floor of validate: the retrains and target losses alone, as a user's own script would run them.
    Load the model, tokenize, and per LDS subset put the start weights back, train on its rows (gradspec's
    response loss, AdamW, clipping, the linear decay: the steps validate takes) and measure every target's loss."""
    import torch

    from gradspec.data.batching import Item, pad_batch, pad_id_of
    from gradspec.data.models import load_model
    from gradspec.data.readers import Fields, read_samples
    from gradspec.data.templates import tokenize
    from gradspec.engine.loss import item_losses, response_losses
    from gradspec.validation.retrain import MAX_GRAD_NORM, Recipe, batches
    from gradspec.validation.subsets import lds_subset

    model, tokenizer = load_model(progress=False)
    tokens = {path: [(s, tokenize(s.messages, tokenizer, "plain", max_length)) for s in read_samples(path, Fields())]
              for path in (pool_path, target_path)}
    rows = {s.index: t for s, t in tokens[pool_path]}
    targets = [Item(s, t) for s, t in tokens[target_path]]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    recipe, pad_id = Recipe(batch_size=batch_size, learning_rate=learning_rate), pad_id_of(tokenizer)
    for k in range(subsets):
        members = lds_subset(sorted(rows), 0.5, 0, k)
        model.load_state_dict(start)
        steps = batches(members, recipe, 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s, n=len(steps): 1 - s / n)  # noqa: B008
        model.train()
        for batch in steps:
            loss = response_losses(model, *pad_batch([rows[i] for i in batch], pad_id, "cpu"))[0].mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        [loss for _, loss, _ in item_losses(model, tokenizer, targets)]


# Peak RSS: VmHWM, the high-water mark of the measured process's own memory map (Linux). Not getrusage's
# ru_maxrss: Linux carries that over an exec (a child started from pytest with a model loaded reports at
# least the parent's peak), and a child's RUSAGE_CHILDREN/wait4 figure has the same fault.
def status_kib(field: str, pid: int | str = "self") -> int:
    """One kB field of /proc/<pid>/status (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM) in MiB."""
    return status_kib("VmHWM") / 1024


def reset_peak_rss() -> None:
    """Set this process's VmHWM to its current RSS (so what ran before, loading say, does not count)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


PEAK_RSS_LINE = "peak_rss_kib"
# Runs a Python command (a script, -m module or -c code, then its arguments) in this interpreter and
# writes the process's VmHWM to stderr as it exits. Standard library only: bergson's venv runs it too.
_PEAK_RSS_WRAPPER = f"""import atexit, runpy, sys
def _peak():
    with open('/proc/self/status') as f:
        kib = next(int(x.split()[1]) for x in f if x.startswith('VmHWM:'))
    print('{PEAK_RSS_LINE}', kib, file=sys.stderr, flush=True)
atexit.register(_peak)
sys.argv = sys.argv[1:]
if sys.argv[0] == '-m':
    del sys.argv[0]
    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
elif sys.argv[0] == '-c':
    code = sys.argv.pop(1)
    exec(compile(code, '<string>', 'exec'), {{'__name__': '__main__'}})
else:
    runpy.run_path(sys.argv[0], run_name='__main__')
"""


def with_peak_rss(argv: Sequence[str]) -> list[str]:
    """argv, a Python command ([python, script | -m module | -c code, args...]), as one that also writes its
    own peak RSS to stderr at exit (read it with peak_rss_in): the same work, measured in the process itself."""
    python, *rest = argv
    return [python, "-c", _PEAK_RSS_WRAPPER, *rest]


def peak_rss_in(text: str) -> float:
    """The peak RSS in MiB that a with_peak_rss command wrote (its last such line) in text."""
    lines = [line for line in text.splitlines() if line.startswith(PEAK_RSS_LINE + " ")]
    if not lines:
        raise ValueError(f"no '{PEAK_RSS_LINE}' line: the command did not reach its exit handlers")
    return int(lines[-1].split()[1]) / 1024
