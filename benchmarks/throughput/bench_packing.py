"""Whether `gradspec score` should pack its batches: the pass it would run either way, padded
against packed, on SmolLM2-135M-Instruct.

Rows, for each set of 4 random sequences: one forward and input-gradient backward of the base model
(the work every scoring pass does whatever it captures), on

- padded: the sequences right-padded to the longest (score's batches today);
- packed: the sequences in one row, position ids restarting at each, and the block-diagonal causal
  mask that isolates them on the CPU's attention kernels (sdpa and eager do not isolate packed
  sequences from position ids alone: tests/training/test_monitor.py).

Packing saves the padded tokens' work in every linear layer, and costs attention over the whole
packed row, which the 4-D mask does not skip. The sets run from 3% to 53% padding; score's batcher
keeps padding under 20% of a batch (data.batching.MAX_PADDING), and real data gives 1-4%
(benchmarks/RESULTS.md). ROUNDS interleaved rounds after a warm-up; medians. Run with
``pytest benchmarks/throughput/bench_packing.py -s``.
"""

import statistics

import pytest
import torch

from benchmarks.common import REPO, interleaved_rounds
from gradspec.data.models import load_model

ROUNDS = 3
SETS = ([500, 510, 520, 530], [200, 210, 220, 240], [100, 150, 200, 250], [60, 120, 240, 480])


def padded(lengths: list[int], ids: list[torch.Tensor]) -> dict:
    T = max(lengths)
    input_ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": input_ids, "attention_mask": mask}


def packed(lengths: list[int], ids: list[torch.Tensor]) -> dict:
    L = sum(lengths)
    sequence = torch.cat([torch.full((n,), j) for j, n in enumerate(lengths)])
    block = torch.tril(torch.ones(L, L, dtype=torch.bool)) & (sequence[:, None] == sequence[None, :])
    return {"input_ids": torch.cat(ids)[None], "attention_mask": block[None, None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}


def one_pass(model: torch.nn.Module, batch: dict) -> None:
    """Forward and input-gradient backward (frozen weights: no weight-gradient GEMMs)."""
    inputs = model.model.embed_tokens(batch["input_ids"]).requires_grad_(True)
    rest = {k: v for k, v in batch.items() if k != "input_ids"}
    model.model(inputs_embeds=inputs, **rest).last_hidden_state.pow(2).mean().backward()


def test_packed_against_padded_passes():
    model, _ = load_model()
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    rows, padding = {}, {}
    for lengths in SETS:
        ids = [torch.randint(3, 49152, (n,), generator=g) for n in lengths]
        name = "/".join(map(str, lengths))
        padding[name] = 1 - sum(lengths) / (len(lengths) * max(lengths))
        for kind, make in (("padded", padded), ("packed", packed)):
            batch = make(lengths, ids)
            rows[f"{name} {kind}"] = lambda batch=batch: one_pass(model, batch)
    for row in rows.values():
        row()  # warm-up
    times = interleaved_rounds(rows, ROUNDS, "packing, ")
    med = {row: statistics.median(t) for row, t in times.items()}
    print(f"\nSmolLM2-135M-Instruct, 4 sequences per pass, forward + input-gradient backward; "
          f"median of {ROUNDS} rounds")
    for name, share in padding.items():
        a, b = med[f"{name} padded"], med[f"{name} packed"]
        print(f"  {name:20s} padding {share:4.0%}  padded {a:6.3f} s  packed {b:6.3f} s  packed / padded {b / a:4.2f}")


SHARED = REPO.parent / "shared" / "data" / "gradient_unified"
REAL = ("reward/wiz_10k_highest_200.json", "reward/mag_10k_lowest_200.json", "ifd_gpt2/her_10k_highest_200.json",
        "reasoning/gsm8k_R1.json")


@pytest.mark.skipif(not SHARED.exists(), reason="the shared data sets are not here")
def test_padding_of_score_batches_on_real_data():
    """The share of padded tokens in score's own batches (plain template, SmolLM2's tokenizer, the
    default --batch-tokens), on published SFT subsets: what packing could save at most."""
    from transformers import AutoTokenizer

    from gradspec.data.batching import BATCH_TOKENS, Item, token_batches
    from gradspec.data.models import default_model_path
    from gradspec.data.readers import Fields, read_samples
    from gradspec.data.templates import tokenize

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    for name in REAL:
        items = [Item(s, tokenize(s.messages, tokenizer, "plain", 2048))
                 for s in read_samples(SHARED / name, Fields()) if s.error is None]
        batches = list(token_batches([i for i in items if i.tokens.scorable], BATCH_TOKENS))
        real = sum(i.tokens.num_tokens for b in batches for i in b)
        padded_tokens = sum(len(b) * max(i.tokens.num_tokens for i in b) for b in batches)
        print(f"\n{name}: {len(items)} rows, {len(batches)} passes, padding {1 - real / padded_tokens:.1%}")
