"""Why didn't SFT learn it? Finds training samples a fine-tuned model does not reproduce and
attributes each to one cause ("Why Supervised Fine-Tuning Fails to Learn").

Detection (on the fine-tuned model): teacher-forced token accuracy and loss; reproduction: the
greedy continuation of the prompt (exact match, prefix match, ROUGE-L on tokens) and the best of R
sampled ones; and the likelihood test: the gold response must be more likely, given the prompt,
than K distractors (responses of the most similar other prompts), in each of R draws of
distractors. With criterion "reproduction" (default) a sample is unlearned when neither the greedy
nor any sampled continuation reaches ROUGE-L >= reproduced_rouge; with "likelihood", when the gold
response loses every draw. The other signals are kept as evidence.

Attribution, first match wins (each rule's evidence is kept in the table):
1. inconsistent_data: a near-duplicate prompt in the data has a divergent response;
2. forgetting: learned at an earlier checkpoint (token accuracy >= learned_accuracy), lost since;
3. pretraining_conflict: the base model knows the prompt's content (its perplexity on the prompt
   is within familiar_margin of the data's lower quartile), confidently predicts other tokens for the response
   (top-1 probability >= conflict_confidence on a wrong token for >= conflict_share of it), and
   the fine-tuned and base next-token distributions differ (mean Jensen-Shannon >= js_threshold);
4. missing_knowledge: the base model gives the response very low likelihood (mean target-token
   probability < missing_probability) without knowing the prompt's content;
5. under_training: none of the above (the loss still falling since the last checkpoint, a long
   response, or its share of rare tokens is shown as evidence).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from rapidfuzz.distance import LCSseq

from gradspec.choices import MAX_LENGTH
from gradspec.data.batching import BATCH_TOKENS, Item, pad_batch, pad_id_of, token_batches
from gradspec.data.errors import InputError, check_at_least, check_covers, check_writable
from gradspec.data.models import check_device, check_model, fit_to_context, load_model
from gradspec.data.readers import Fields, Sample, read_samples
from gradspec.data.templates import IGNORE_INDEX, Tokenized, check_response_tokens, tokenize
from gradspec.diagnose.report import write_diagnosis
from gradspec.diagnose.thresholds import Thresholds
from gradspec.engine.loss import next_token_positions
from gradspec.options import OptionError, OptionExists, mention
from gradspec.runs.score_files import check_scored_input, module_mean, read_metadata, read_scores
from gradspec.training.dynamics import from_checkpoints, measure, measure_tokens, read_dynamics, summarise

OUTPUTS = ("diagnosis.parquet", "report.md")  # what a diagnosis writes into --out
CAUSES = ("inconsistent_data", "forgetting", "pretraining_conflict", "missing_knowledge", "under_training")


def rouge_l(candidate: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 on token ids."""
    if not candidate or not reference:
        return float(candidate == reference)
    lcs = LCSseq.similarity(candidate, reference)
    return 0.0 if lcs == 0 else 2 * lcs / (len(candidate) + len(reference))


def _split(tokens: Tokenized) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a tokenized single-turn sample."""
    start = next((k for k, label in enumerate(tokens.labels) if label != IGNORE_INDEX), len(tokens.labels))
    end = max((k + 1 for k, label in enumerate(tokens.labels) if label != IGNORE_INDEX), default=start)
    return tokens.input_ids[:start], tokens.input_ids[start:end]


@torch.no_grad()
def prompt_embeddings(model, tokenizer, prompts: list[list[int]]) -> torch.Tensor:
    """Mean last hidden state over each prompt's tokens, centred over the data and unit length
    (centring removes the direction every prompt shares); row k for prompts[k]."""
    device = next(model.parameters()).device
    pad_id = pad_id_of(tokenizer)
    items = [Item(Sample(k, []), Tokenized(ids or [pad_id], ids or [pad_id], "ok")) for k, ids in enumerate(prompts)]
    out = torch.zeros(len(prompts), model.config.hidden_size, dtype=torch.float64)
    for batch in token_batches(items, BATCH_TOKENS):
        ids, mask, _ = pad_batch([b.tokens for b in batch], pad_id, device)
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
        means = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        for item, mean in zip(batch, means.cpu(), strict=True):
            out[item.sample.index] = mean
    out -= out.mean(0)
    return torch.nn.functional.normalize(out, dim=1)


def nearest(embeddings: torch.Tensor, k: int, block: int = 4096) -> np.ndarray:
    """(n, k) indices of each row's most similar other rows by cosine, a block of rows at a time
    (memory O(block x n), not n x n)."""
    k = min(k, len(embeddings) - 1)
    out = np.zeros((len(embeddings), max(k, 0)), dtype=np.int64)
    for start in range(0, len(embeddings), block):
        sims = embeddings[start:start + block] @ embeddings.T
        rows = torch.arange(len(sims))
        sims[rows, rows + start] = -math.inf
        out[start:start + block] = torch.topk(sims, k, dim=1).indices.numpy()
    return out


def _likelihood_test(model, tokenizer, samples: list[Sample], neighbours: np.ndarray, responses: list[list[int]],
                     gold: dict[int, dict[str, Any]], t: Thresholds, template: str,
                     max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(share of draws the gold response wins, distractors available) per sample; gold: the
    model's measures of the samples themselves."""
    pairs, owners = [], []
    for k, s in enumerate(samples):
        pool = [j for j in neighbours[k] if responses[j] != responses[k]][: t.pool]
        for j in pool:
            messages = [*s.messages[:-1], samples[j].messages[-1]]
            pairs.append(Sample(len(pairs), messages))
            owners.append((k, j))
    other = measure(model, tokenizer, pairs, template, max_length)
    rng = np.random.default_rng(t.seed)
    wins = np.full(len(samples), np.nan)
    available = np.zeros(len(samples), dtype=int)
    by_sample: dict[int, list[float]] = {}
    for (k, _), pair in zip(owners, pairs, strict=True):
        by_sample.setdefault(k, []).append(other[pair.index]["perplexity"])
    for k, s in enumerate(samples):
        rivals = np.array(by_sample.get(k, []))
        available[k] = len(rivals)
        if not len(rivals):
            continue
        draws = [rng.choice(rivals, size=min(t.distractors, len(rivals)), replace=False) for _ in range(t.repetitions)]
        wins[k] = np.mean([gold[s.index]["perplexity"] < d.min() for d in draws])
    return wins, available


@torch.no_grad()
def _continuations(model, tokenizer, prompt: list[int], response: list[int], sampled: int) -> list[list[int]]:
    """The greedy continuation of the prompt, then `sampled` sampled ones (temperature 1), each as
    long as the response and cut at the end-of-sequence token."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    settings = {"attention_mask": torch.ones_like(ids), "max_new_tokens": max(len(response), 1),
                "pad_token_id": tokenizer.pad_token_id}
    greedy = model.generate(ids, do_sample=False, **settings)
    outs = [greedy[0]]
    if sampled:
        outs += list(model.generate(ids, do_sample=True, temperature=1.0, top_k=0, num_return_sequences=sampled,
                                    **settings))
    cut = []
    for out in outs:
        generated = out[len(prompt):].tolist()
        if tokenizer.eos_token_id in generated and tokenizer.eos_token_id not in response:
            generated = generated[: generated.index(tokenizer.eos_token_id)]
        cut.append(generated)
    return cut


@torch.no_grad()
def _base_comparison(base, tuned, tokenizer, items: list[Item], t: Thresholds) -> dict[int, dict[str, float]]:
    """Per sample over its response tokens: the share where the base model confidently predicts a
    wrong token, and the mean Jensen-Shannon divergence of base vs fine-tuned next-token laws."""
    device = next(tuned.parameters()).device
    pad_id = pad_id_of(tokenizer)
    out = {i.sample.index: dict.fromkeys(("base_top_probability", "base_confident_disagreement", "js_divergence"),
                                         math.nan) for i in items}
    for batch in token_batches([i for i in items if i.tokens.scorable], BATCH_TOKENS):
        ids, mask, labels = pad_batch([b.tokens for b in batch], pad_id, device)
        rows, cols, wanted = next_token_positions(labels)
        laws = []
        for model in (base, tuned):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1][rows, cols].double()
            laws.append(torch.log_softmax(logits, -1))
        base_logp, tuned_logp = laws
        top_p, top = base_logp.exp().max(-1)
        disagree = ((top != wanted) & (top_p >= t.conflict_confidence)).double()
        middle = torch.logsumexp(torch.stack([base_logp, tuned_logp]), 0) - math.log(2)
        js = 0.5 * sum((logp.exp() * (logp - middle)).sum(-1) for logp in (base_logp, tuned_logp))
        for k, item in enumerate(batch):
            here = rows == k
            out[item.sample.index] = {"base_top_probability": float(top_p[here].mean()),
                                      "base_confident_disagreement": float(disagree[here].mean()),
                                      "js_divergence": float(js[here].mean())}
    return out


def _reproduction(tuned, tokenizer, prompt: list[int], gold: list[int], t: Thresholds) -> dict[str, float]:
    """How well the model reproduces the response: greedy (exact, prefix, ROUGE-L), best sampled."""
    generated, *sampled = _continuations(tuned, tokenizer, prompt, gold, t.repetitions)
    prefix = next((n for n, (a, b) in enumerate(zip(generated, gold, strict=False)) if a != b),
                  min(len(generated), len(gold)))
    return {"exact_match": generated[: len(gold)] == gold, "prefix_match": prefix / max(len(gold), 1),
            "rouge_l": rouge_l(generated, gold),
            "best_sampled_rouge_l": max((rouge_l(g, gold) for g in sampled), default=math.nan)}


def detect(tuned, base, tokenizer, samples: list[Sample], template: str = "plain", max_length: int = MAX_LENGTH,
           thresholds: Thresholds = Thresholds()) -> pd.DataFrame:
    """One row per sample: its tokenizer status, the detection signals, the base model's view of
    the response and of the prompt, and the nearest other prompt with its response's ROUGE-L
    against this one. A sample with no response token to judge keeps its status and gets no
    signals and no verdict (`unlearned` is NA); most samples without one stop the run."""
    items = [Item(s, tokenize(s.messages, tokenizer, template, max_length)) for s in samples]
    check_response_tokens(Counter(i.tokens.status for i in items))
    judged = [i for i in items if i.tokens.scorable]
    rows = _judge(tuned, base, tokenizer, judged, template, max_length, thresholds) if judged else []
    rows += [{"index": i.sample.index} for i in items if not i.tokens.scorable]
    status = {i.sample.index: i.tokens.status for i in items}
    table = pd.DataFrame(rows).set_index("index").loc[[s.index for s in samples]].reset_index()
    table.insert(1, "status", table["index"].map(status))
    table["unlearned"] = table["unlearned"].astype("boolean")
    return table


def _judge(tuned, base, tokenizer, items: list[Item], template: str, max_length: int,
           t: Thresholds) -> list[dict[str, Any]]:
    """detect()'s rows for samples that have response tokens, compared among themselves."""
    samples = [i.sample for i in items]
    prompts, responses = zip(*(_split(i.tokens) for i in items), strict=True)
    order = nearest(prompt_embeddings(tuned, tokenizer, list(prompts)), max(t.pool * 2, 1))
    tuned_view = measure_tokens(tuned, tokenizer, items)
    base_view = measure_tokens(base, tokenizer, items)
    wins, available = _likelihood_test(tuned, tokenizer, samples, order, list(responses), tuned_view, t, template,
                                       max_length)
    # How well the base model knows the prompt itself, its "related content"
    base_prompt = measure_tokens(base, tokenizer, [Item(s, Tokenized(list(p), list(p), "ok"))
                                                   for s, p in zip(samples, prompts, strict=True)])
    comparison = _base_comparison(base, tuned, tokenizer, items, t)
    frequency = Counter(token for response in responses for token in response)
    torch.manual_seed(t.seed)
    rows = []
    for k, s in enumerate(samples):
        gold = list(responses[k])
        reproduction = _reproduction(tuned, tokenizer, list(prompts[k]), gold, t)
        reproduced = max(reproduction["rouge_l"], np.nan_to_num(reproduction["best_sampled_rouge_l"]))
        by_likelihood = t.criterion == "likelihood" and not math.isnan(wins[k])
        # Near-duplicates: the lexically closest of the prompts most similar by embedding
        prompt_similarity, twin = max(((rouge_l(list(prompts[j]), list(prompts[k])), int(j))
                                       for j in order[k, : t.pool]), default=(0.0, -1))
        rows.append({
            "index": s.index, "response_tokens": len(gold), "loss": math.log(tuned_view[s.index]["perplexity"]),
            "rare_token_share": sum(frequency[x] <= t.rare_count for x in gold) / max(len(gold), 1),
            "token_accuracy": tuned_view[s.index]["token_accuracy"], **reproduction,
            "likelihood_wins": wins[k], "distractors_available": int(available[k]),
            "unlearned": bool(wins[k] == 0) if by_likelihood else reproduced < t.reproduced_rouge,
            "base_token_prob": base_view[s.index]["mean_token_prob"],
            "base_token_accuracy": base_view[s.index]["token_accuracy"],
            "base_prompt_perplexity": base_prompt[s.index]["perplexity"],
            **comparison[s.index],
            "nearest_prompt": samples[twin].index if twin >= 0 else -1,
            "nearest_prompt_similarity": prompt_similarity,
            "nearest_response_rouge_l": rouge_l(list(responses[twin]), gold) if twin >= 0 else math.nan,
        })
    return rows


def attribute(table: pd.DataFrame, dynamics: pd.DataFrame | None = None,
              thresholds: Thresholds = Thresholds()) -> pd.DataFrame:
    """Adds `cause` (None for learned samples) and the checkpoint evidence to detect()'s table.
    dynamics: per-sample token_accuracy and perplexity lists over earlier checkpoints, oldest first."""
    t = thresholds
    table = table.copy()
    table["learned_before"] = None  # not assessed without checkpoints: never a measured "no"
    table["loss_falling"] = None
    if dynamics is not None:
        d = dynamics.set_index("index").reindex(table["index"])
        table["learned_before"] = [any(a >= t.learned_accuracy for a in acc) if isinstance(acc, list | np.ndarray)
                                   else False for acc in d["token_accuracy"]]
        final = np.exp(table["loss"].to_numpy())  # the fine-tuned model's, after the last checkpoint
        table["loss_falling"] = [isinstance(p, list | np.ndarray) and len(p) > 0 and now < (1 - t.falling_loss) * p[-1]
                                 for p, now in zip(d["perplexity"], final, strict=True)]
    inconsistent = (table["nearest_prompt_similarity"] >= t.near_duplicate) & (
        table["nearest_response_rouge_l"] < t.divergent_rouge)
    forgot = (table["learned_before"] == True) & (table["token_accuracy"] < t.learned_accuracy)  # noqa: E712
    known = table["base_prompt_perplexity"]
    familiar = known <= (1 + t.familiar_margin) * known.quantile(0.25)
    conflict = familiar & (table["base_confident_disagreement"] >= t.conflict_share) & (
        table["js_divergence"] >= t.js_threshold)
    missing = ~familiar & (table["base_token_prob"] < t.missing_probability)
    rules = [inconsistent, forgot, conflict, missing]
    unlearned = table["unlearned"].fillna(False).astype(bool)  # NA: not judged (see detect)
    causes = []
    for k in range(len(table)):
        if not unlearned.iloc[k]:
            causes.append(None)
            continue
        causes.append(next((c for c, rule in zip(CAUSES, rules, strict=False) if rule.iloc[k]), CAUSES[-1]))
    table["cause"] = causes
    return table


def with_spectra(table: pd.DataFrame, scores: str | Path) -> pd.DataFrame:
    """Adds each sample's mean nuclear norm and effective rank over modules from a score file."""
    wide = read_scores(scores)[0].set_index("index")
    extra = pd.DataFrame({f"spectral_{m}": module_mean(wide, m) for m in ("nuclear_norm", "effective_rank")})
    return table.join(extra, on="index")


def diagnose(base: str, model: str, data: str | Path, out: str | Path, checkpoints: list[str] | None = None,
             dynamics: str | Path | None = None, scores: str | Path | None = None, template: str = "plain",
             max_length: int = MAX_LENGTH, limit: int | None = None, device: str = "cpu",
             thresholds: Thresholds = Thresholds(), overwrite: bool = False, fields: Fields = Fields()) -> Path:
    """Detects and explains the unlearned samples of `model` (fine-tuned from `base` on `data`);
    writes diagnosis.parquet and report.md under out and returns the report's path."""
    check_at_least({"limit": limit, "max_length": max_length})
    check_device(device)
    if dynamics is not None and checkpoints:
        raise OptionError((), f"give {mention('dynamics')} or {mention('checkpoints')}, not both")
    for name, given in ((base, "base"), (model, "model"), *((c, "checkpoints") for c in checkpoints or [])):
        check_model(name, given)
    if Path(out).exists() and not Path(out).is_dir():
        raise OptionError("out", f"{out} is a file; diagnose writes a folder")
    earlier = [name for name in OUTPUTS if (Path(out) / name).exists()]
    if earlier and not overwrite:
        raise OptionExists("out", f"{out} holds an earlier diagnosis ({', '.join(earlier)}); pass "
                           f"{mention('overwrite')} or choose another {mention('out')}")
    check_writable(out, as_folder=True)
    samples = list(read_samples(data, fields, limit=limit))
    if not samples:
        raise InputError(f"{data}: no rows")
    indices = [s.index for s in samples]
    if dynamics is not None:
        check_covers(read_dynamics(dynamics)[0]["index"], indices, "dynamics", dynamics)
    if scores is not None:
        check_scored_input(read_metadata(scores), data, scores)
        check_covers(pq.read_table(scores, columns=["index"])["index"].to_pylist(), indices, "scores", scores)
    tuned, tokenizer = load_model(model, device)
    base_model, _ = load_model(base, device)
    max_length = fit_to_context(max_length, tuned, base_model)  # both models read the same tokens
    table = detect(tuned, base_model, tokenizer, samples, template, max_length, thresholds)
    history = None
    if dynamics is not None:
        history = read_dynamics(dynamics)[0]
    elif checkpoints:
        history = summarise(from_checkpoints(checkpoints, samples, template, max_length, device))
    table = attribute(table, history, thresholds)
    if scores is not None:
        table = with_spectra(table, scores)
    return write_diagnosis(table, samples, out)
