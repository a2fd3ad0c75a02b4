"""The diagnosis as a folder: diagnosis.parquet (one row per sample, all the evidence) and
report.md, written for someone who has not read the paper."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from gradspec.data.readers import Sample
from gradspec.runs.score_files import write_parquet

EXPLAIN = {
    "inconsistent_data": (
        "Inconsistent data",
        "Another sample has (nearly) the same prompt but a different response. The model cannot fit "
        "both; whichever it leans to, the other stays unlearned.",
        "Deduplicate or reconcile the responses; at least keep contradicting samples out of the same batch.",
    ),
    "forgetting": (
        "Forgetting",
        "The sample was learned at an earlier checkpoint and lost later: later data overwrote it "
        "(typical of sequential fine-tuning, hitting the earliest data).",
        "Shuffle globally instead of training stage by stage, or resample (replay) earlier data later on.",
    ),
    "pretraining_conflict": (
        "Conflict with pre-training",
        "The base model knows the prompt's content and confidently predicts something else: fine-tuning "
        "has to overturn what pre-training taught, and did not.",
        "Check the label first. If the SFT answer is right, it needs more weight or more epochs than the "
        "rest of the data to override the prior.",
    ),
    "missing_knowledge": (
        "Missing prerequisite knowledge",
        "The base model gives the response very low likelihood and does not know the prompt's content: "
        "the fact was never learned in pre-training, and a few SFT steps do not teach it.",
        "Continued pre-training on the missing knowledge before SFT.",
    ),
    "under_training": (
        "Insufficient optimisation",
        "None of the above: the loss may still be falling at the last checkpoints, or the response is long "
        "or made of rare patterns.",
        "More epochs, with early stopping on held-out data.",
    ),
}

EVIDENCE = {
    "inconsistent_data": ["nearest_prompt", "nearest_prompt_similarity", "nearest_response_rouge_l"],
    "forgetting": ["learned_before", "loss", "position"],
    "pretraining_conflict": ["base_prompt_perplexity", "base_confident_disagreement", "js_divergence"],
    "missing_knowledge": ["base_prompt_perplexity", "base_token_prob", "base_token_accuracy"],
    "under_training": ["loss_falling", "loss", "response_tokens", "rare_token_share"],
}
DETECTION = ["token_accuracy", "rouge_l", "best_sampled_rouge_l", "likelihood_wins"]


def _snippet(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return (text[: n - 1] + "…" if len(text) > n else text).replace("|", "\\|")


def _not_judged(table: pd.DataFrame) -> list[str]:
    """A paragraph on the samples with no response token to judge (by status), if any."""
    flagged = table[table["unlearned"].isna()]
    if flagged.empty:
        return []
    counts = ", ".join(f"{n} `{status}`" for status, n in flagged["status"].value_counts().items())
    return [f"{len(flagged)} more samples were not judged: they have no response token to score ({counts}; "
            "see `status` in `diagnosis.parquet` and the statuses in gradspec's docs/inputs.md).", ""]


def write_diagnosis(table: pd.DataFrame, samples: list[Sample], out: str | Path, examples: int = 3) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = table.assign(position=table["index"] / max(len(table) - 1, 1))
    write_parquet(table, out / "diagnosis.parquet")
    by_index = {s.index: s for s in samples}
    unlearned = table[table["unlearned"].fillna(False).astype(bool)]
    judged = int(table["unlearned"].notna().sum())
    lines = [
        "# Why didn't SFT learn it?", "",
        f"{len(unlearned)} of {judged} training samples ({len(unlearned) / max(judged, 1):.1%}) are "
        "**unlearned**: the fine-tuned model does not reproduce them (see `diagnosis.parquet` for every "
        "signal of every sample). Each is attributed to the first cause whose evidence it shows, in the "
        "order below.", "",
        *_not_judged(table),
        "| cause | samples | share of unlearned | what helps |", "| --- | ---: | ---: | --- |",
    ]
    counts = unlearned["cause"].value_counts()
    history = table["learned_before"].notna().any()  # checkpoints given: forgetting can be seen
    for cause, (title, _, helps) in EXPLAIN.items():
        n = int(counts.get(cause, 0))
        if cause == "forgetting" and not history:
            lines.append(f"| {title} | not assessed | | needs earlier checkpoints: --checkpoints or --dynamics |")
            continue
        lines.append(f"| {title} | {n} | {n / max(len(unlearned), 1):.0%} | {helps} |")
    for cause, (title, meaning, helps) in EXPLAIN.items():
        rows = unlearned[unlearned["cause"] == cause]
        if rows.empty:
            continue
        lines += ["", f"## {title} ({len(rows)})", "", meaning, "", f"What helps: {helps}", ""]
        columns = ["index", *DETECTION, *EVIDENCE[cause]]
        lines += ["| prompt | response | " + " | ".join(columns) + " |", "| --- | --- |" + " ---: |" * len(columns)]
        for _, row in rows.head(examples).iterrows():
            sample = by_index[row["index"]]
            prompt = "\n".join(m["content"] for m in sample.messages[:-1])
            cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
            response = _snippet(sample.messages[-1]["content"])
            lines.append(f"| {_snippet(prompt)} | {response} | " + " | ".join(cells) + " |")
    lines += ["", "## How samples are judged", "",
              "- **unlearned**: neither the greedy continuation of the prompt nor any of the sampled ones reaches "
              "ROUGE-L ≥ the reproduction threshold against the training response (`rouge_l`, "
              "`best_sampled_rouge_l`); `likelihood_wins` is the share of draws in which the gold response was "
              "more likely than the responses of the most similar other prompts.",
              "- thresholds are in `gradspec.diagnose.thresholds.Thresholds` and the CLI's options."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"
