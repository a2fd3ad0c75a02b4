"""The analysis of retrain files: each score's LDS with its interval, the selection outcome's gains over
random, the removal test's effects against random removal, as text for the terminal and as a report folder
(report.md, figures, CSV tables) in the style of gradspec report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from matplotlib.figure import Figure

from gradspec.analysis.report import report_folder
from gradspec.data.errors import InputError
from gradspec.files import parquet_errors
from gradspec.invocation import program
from gradspec.runs.score_files import parquet_schema, schema_metadata
from gradspec.validation.lds import RESPONSE_TOKENS, lds, partial_lds, predictions
from gradspec.validation.objectives import OBJECTIVE, objective_table, objectives_report, objectives_summary
from gradspec.validation.outcome import interval_text, outcome_table
from gradspec.validation.removal import REMOVAL, removal_table, report_lines, summary_lines
from gradspec.validation.scores import read_score

NEEDED = ("kind", "members", "target_loss")
LENGTH_SCORE = "length (response tokens)"  # the row of length's own LDS, the control of the LDS beyond length
LACKING = "lacking_response_tokens"  # analysis info: the first file that does not record them


@dataclass
class Analysis:
    """What the retrain files say of the scores. lds: one row per score; outcome: one row per selection;
    points: per score, each subset's (mean prediction over targets, mean measured target loss)."""

    files: list[str]
    retrains: pd.DataFrame
    info: dict
    lds: pd.DataFrame = field(default_factory=pd.DataFrame)
    outcome: pd.DataFrame = field(default_factory=pd.DataFrame)
    points: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    beyond_length: bool = False  # the LDS table has each score's LDS beyond length
    removal: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per score and end removed
    objectives: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per objective, NTP first


def read_retrains(files: list[str]) -> tuple[pd.DataFrame, dict]:
    """The retrain rows of validate's files, and what their run recorded (the first file's); files of other
    pools or targets are refused."""
    frames, info = [], None
    for path in files:
        schema = parquet_schema(path, "pass a retrain file: gradspec validate's --out")
        missing = [c for c in NEEDED if c not in schema.names]
        meta = schema_metadata(schema)
        if missing or "targets" not in meta:
            raise InputError(f"{path}: not a retrain file of gradspec validate (no {(missing or ['targets'])[0]} "
                             f"{'column' if missing else 'in its metadata'}); pass validate's --out")
        if info is not None and (meta.get("rows"), meta.get("targets"), meta.get("target")) != \
                (info.get("rows"), info.get("targets"), info.get("target")):
            raise InputError(f"{path}: retrains of another pool or target than {files[0]} ({meta.get('rows')} rows, "
                             f"{meta.get('targets')} targets from {meta.get('target')}); analyse them apart")
        if info is not None and meta.get(RESPONSE_TOKENS) != info.get(RESPONSE_TOKENS):
            if meta.get(RESPONSE_TOKENS) is not None and info.get(RESPONSE_TOKENS) is not None:
                raise InputError(f"{path}: its pool's rows have other response-token counts than {files[0]}'s "
                                 "(another --max-length or --template?); analyse them apart")
            info = {**info, RESPONSE_TOKENS: None, LACKING: info.get(LACKING) or path}
        info = info or ({**meta, LACKING: path} if meta.get(RESPONSE_TOKENS) is None else meta)
        with parquet_errors(path):
            frame = pd.read_parquet(path)
        _check_retrains(path, schema, frame, meta)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True), info or {}


def _numbers(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _list_of(holds: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    return lambda kind: (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and \
        (holds(kind.value_type) or pa.types.is_null(kind.value_type))


def _text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)  # pandas writes either


# What analyse reads of a retrain file's columns, and what each must hold (any of them may be all null)
COLUMNS = {"kind": _text, "members": _list_of(pa.types.is_integer), "target_loss": _list_of(_numbers),
           "selection": _text, "buckets": pa.types.is_integer, "seed": pa.types.is_integer,
           "metric": _numbers, "removed": _text}


def _check_retrains(path: str, schema: pa.Schema, frame: pd.DataFrame, meta: dict) -> None:
    """A retrain file's rows as analyse reads them: an InputError naming the file, the row and the field
    where one is not what validate writes."""
    rows, targets = meta.get("rows"), meta.get("targets")
    if not isinstance(rows, int) or not isinstance(targets, int):
        raise InputError(f"{path}: its metadata holds no count of rows and targets; pass validate's --out")
    for name, holds in COLUMNS.items():
        kind = schema.field(name).type if name in schema.names else None
        if kind is not None and not (holds(kind) or pa.types.is_null(kind)):
            raise InputError(f"{path}: its {name} column holds {kind}; pass validate's --out")
    needed = {"lds": ("members", "target_loss"), "outcome": ("target_loss", "selection", "buckets", "seed"),
              REMOVAL: ("target_loss", "selection", "removed", "seed"), OBJECTIVE: ("target_loss", "selection", "seed")}
    for k, row in enumerate(frame.to_dict("records")):
        if not isinstance(row["kind"], str):
            raise InputError(f"{path}: row {k} has no kind (lds, outcome, removal or objective); pass validate's "
                             "--out")
        for name in needed.get(row["kind"], ()):
            value = row.get(name)
            if value is None or (np.ndim(value) == 0 and pd.isna(value)):
                raise InputError(f"{path}: row {k} has no {name}; pass validate's --out")
        members, losses = row["members"], row["target_loss"]
        if members is not None and (pd.isna(members).any() or any(not 0 <= m < rows for m in members)):
            raise InputError(f"{path}: row {k}'s members are not rows of its {rows}-row pool; pass validate's --out")
        if losses is not None and len(losses) != targets:
            raise InputError(f"{path}: row {k} has {len(losses)} target losses, not one per target example "
                             f"({targets}); pass validate's --out")


def analyse(files: list[str], specs: list[str], resamples: int = 1000, confidence: float = 0.95,
            seed: int = 0) -> Analysis:
    """Each score's LDS over the files' LDS retrains (a per-sample score against the mean target loss), and
    the outcome retrains' gains over random."""
    retrains, info = read_retrains(files)
    analysis = Analysis(list(files), retrains, info)
    subsets = retrains[retrains["kind"] == "lds"]
    if specs and len(subsets) < 3:
        raise InputError(f"{', '.join(files)}: {len(subsets)} LDS retrains; an LDS needs 3 or more subsets "
                         "(--subsets)")
    losses = np.array([list(v) for v in subsets["target_loss"]], dtype=float)
    members = [list(m) for m in subsets["members"]]
    length = _length_prediction(info, members, files) if specs else None
    analysis.beyond_length = length is not None
    rows = []
    if length is not None:  # length's own LDS first: what the scores' LDS beyond length take out
        own = lds(length[:, None], np.nanmean(losses, axis=1, keepdims=True), resamples, confidence, seed)
        rows.append(_lds_row(LENGTH_SCORE, "per-sample", own, None, 0))
    for spec in specs:
        score = read_score(spec, info["rows"], info["targets"], info)
        predicted = predictions(members, score.values)
        measured = losses if score.per_target else np.nanmean(losses, axis=1, keepdims=True)
        result = lds(predicted, measured, resamples, confidence, seed)
        beyond = None if length is None else partial_lds(predicted, measured, length, resamples, confidence, seed)
        rows.append(_lds_row(score.name, "attribution" if score.per_target else "per-sample", result, beyond,
                             score.missing))
        analysis.points[score.name] = (predicted.mean(1), np.nanmean(losses, axis=1))
    analysis.lds = pd.DataFrame(rows)
    chosen = retrains[retrains["kind"] == "outcome"]
    if len(chosen):
        analysis.outcome = outcome_table(chosen, confidence)
    if len(removed := retrains[retrains["kind"] == REMOVAL]):  # none in a file from before the removal test
        analysis.removal = removal_table(removed, confidence)
    if len(trained := retrains[retrains["kind"] == OBJECTIVE]):
        analysis.objectives = objective_table(trained, confidence)
    return analysis


def _lds_row(name: str, kind: str, result, beyond, missing: int) -> dict:
    """A score's row of the LDS table: its LDS and, where the files record the rows' lengths, its LDS beyond
    length (NaN for length itself, and where no target's partial correlation is defined: said by summary)."""
    row = {"score": name, "kind": kind, "lds": result.value, "low": result.low, "high": result.high}
    if beyond is not None or name == LENGTH_SCORE:
        row.update(beyond_length=np.nan if beyond is None else beyond.value,
                   beyond_low=np.nan if beyond is None else beyond.low,
                   beyond_high=np.nan if beyond is None else beyond.high)
    return {**row, "subsets": result.subsets, "targets": int(np.isfinite(result.per_target).sum()), "missing": missing}


def _length_prediction(info: dict, members: list[list[int]], files: list[str]) -> np.ndarray | None:
    """Length's prediction for each LDS subset, its rows' total response tokens (the retrain file's record of
    them); None where a file does not record them (made before gradspec recorded them: said by summary)."""
    tokens = info.get(RESPONSE_TOKENS)
    if tokens is None:
        return None
    if not isinstance(tokens, list) or len(tokens) != info["rows"]:
        raise InputError(f"{files[0]}: its metadata's {RESPONSE_TOKENS} is not one count per row of its "
                         f"{info['rows']}-row pool; pass validate's --out")
    counts = []
    for m in members:
        held = [tokens[i] for i in m]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in held):
            raise InputError(f"{files[0]}: its metadata's {RESPONSE_TOKENS} has no count for a row an LDS retrain "
                             "trained on; pass validate's --out")
        counts.append(sum(held))
    return np.array(counts, dtype=float)


def summary(analysis: Analysis, confidence: float = 0.95) -> str:
    """The analysis in a few lines for the terminal."""
    lines = []
    if len(analysis.lds):
        lines.append(f"LDS (Spearman of predicted and measured target loss across {analysis.lds['subsets'].iloc[0]} "
                     f"subsets, mean over targets; {confidence:.0%} bootstrap interval):")
        for r in analysis.lds.itertuples():
            nan = f"; {r.missing} values missing, counted as 0" if r.missing else ""
            lines.append(f"  {r.score}: {r.lds:+.3f} [{r.low:+.3f}, {r.high:+.3f}]{_beyond(r)} ({r.kind}, "
                         f"{r.targets} targets{nan})")
        lines.append(_beyond_note(analysis))
    if len(analysis.outcome):
        lines.append("Selection outcome (mean target loss; gain = random's loss - its own, same seed, "
                     f"{confidence:.0%} t interval over seeds):")
        for r in analysis.outcome.itertuples():
            label = r.selection + (f" ({r.buckets} length buckets)" if r.buckets else "")
            lines.append(f"  {label}: loss {r.loss:.4f}" + ("" if r.selection == "random" else
                                                            f", gain {r.gain:+.4f} {_gain_interval(r)}"))
    if len(analysis.removal):
        lines += summary_lines(analysis.removal, confidence)
    if len(analysis.objectives):
        lines += objectives_summary(analysis.objectives, confidence)
    return "\n".join(lines) or (f"next: {program()} validate --runs {' '.join(analysis.files)} --scores FILE[:COLUMN] "
                                 "... --report DIR (the LDS of each score against these retrains)")


def write_report(analysis: Analysis, out: str | Path, overwrite: bool = False, confidence: float = 0.95) -> Path:
    """report.md, its figures (predicted vs measured per score, LDS with intervals, outcome gains) and the
    tables as CSV, in folder out."""
    out = report_folder(out, "report", overwrite)
    out.mkdir(parents=True, exist_ok=True)
    info = analysis.info
    lines = ["# gradspec validate", "",
             f"Retrains: {len(analysis.retrains)} ({', '.join(f'`{f}`' for f in analysis.files)}) of "
             f"`{info.get('model')}` on `{info.get('data')}` ({info.get('pool')} of {info.get('rows')} rows usable), "
             f"measured on {info.get('targets')} target examples of `{info.get('target')}`; recipe: "
             f"{_recipe(info)}.", ""]
    if len(analysis.lds):
        analysis.lds.to_csv(out / "lds.csv", index=False)
        _plot_lds(analysis.lds, out / "lds.png", confidence)
        _plot_points(analysis.points, out / "predicted_vs_measured.png")
        lines += ["## LDS", "", "Per target, the Spearman correlation across subsets between the loss change the score "
                  "predicts (the sum of its values over the subset's rows) and the negative measured loss; then "
                  f"the mean over targets, with a {confidence:.0%} bootstrap interval over subsets. Positive: the "
                  "score ranks the subsets as training does.", "", _beyond_note(analysis).strip() + ".", "",
                  "![LDS](lds.png)", "",
                  analysis.lds.to_markdown(index=False, floatfmt=".3f"), ""]
        if analysis.beyond_length:
            lines += ["beyond_length, beyond_low and beyond_high are NaN for length's own row (the control they take "
                      "out) and where no target's partial correlation is defined (a score that ranks the subsets as "
                      "length does, or a constant one).", ""]
        lines += ["![predicted vs measured](predicted_vs_measured.png)", ""]
    if len(analysis.outcome):
        analysis.outcome.to_csv(out / "outcome.csv", index=False)
        _plot_outcome(analysis.outcome, out / "outcome.png")
        lines += ["## Selection outcome", "", "Each selection's mean target loss after retraining on it; gain = "
                  "random's loss minus its own for the same seed (positive: better than random), with a "
                  f"{confidence:.0%} t interval over seeds.", "", "![outcome](outcome.png)", "",
                  analysis.outcome.to_markdown(index=False, floatfmt=".4f"), ""]
        if analysis.outcome.loc[analysis.outcome["selection"] != "random", "gain_low"].isna().any():
            lines += ["gain_low and gain_high are NaN where there is no interval: a selection retrained with one "
                      "seed (--seeds 2 or more give one), or a retrain that measured no finite loss.", ""]
    if len(analysis.removal):
        lines += report_lines(analysis.removal, out, confidence)
    if len(analysis.objectives):
        lines += objectives_report(analysis.objectives, out, confidence, info)
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report


def _beyond(r) -> str:
    """A row's LDS beyond length, or why it has none."""
    if not hasattr(r, "beyond_length"):
        return ""
    if r.score == LENGTH_SCORE:
        return "; beyond length: - (the control itself)"
    if not np.isfinite(r.beyond_length):
        return "; beyond length: none (no target's partial correlation is defined: the score ranks the subsets as " \
               "length does, or is constant)"
    return f"; beyond length {r.beyond_length:+.3f} [{r.beyond_low:+.3f}, {r.beyond_high:+.3f}]"


def _beyond_note(analysis: Analysis) -> str:
    if analysis.beyond_length:
        return ("  beyond length: the same Spearman correlation with length's prediction (each subset's total "
                "response tokens) held fixed, a partial correlation of the ranks; same bootstrap draws")
    return (f"  no LDS beyond length: {analysis.info.get(LACKING)} does not record its rows' response tokens (made "
            "by an older gradspec); retrains made by this version do")


def _gain_interval(r) -> str:
    """The interval over seeds, or why there is none (one seed, a NaN loss) rather than NaNs."""
    return interval_text(r.gain_low, r.gain_high, r.seeds)


def _recipe(info: dict) -> str:
    steps = f"{info.get('max_steps')} steps" if info.get("max_steps", -1) != -1 else f"{info.get('epochs')} epochs"
    lora = f", LoRA rank {info['lora_rank']}" if info.get("lora_rank") else ", full weights"
    return f"{steps}, batch {info.get('batch_size')}, AdamW lr {info.get('learning_rate')}{lora}"


def _plot_lds(table: pd.DataFrame, path: Path, confidence: float) -> None:
    fig = Figure(figsize=(1.5 + 1.2 * len(table), 3.4))
    ax = fig.subplots()
    x = np.arange(len(table))
    below = np.clip(table["lds"] - table["low"], 0, None)
    above = np.clip(table["high"] - table["lds"], 0, None)
    ax.errorbar(x, table["lds"], yerr=[below, above], fmt="o", capsize=4, label="LDS")
    if "beyond_length" in table:
        shown = np.isfinite(table["beyond_length"]).to_numpy()
        beyond = table["beyond_length"][shown]
        ax.errorbar(x[shown] + 0.15, beyond, yerr=[np.clip(beyond - table["beyond_low"][shown], 0, None),
                                                   np.clip(table["beyond_high"][shown] - beyond, 0, None)],
                    fmt="s", capsize=4, label="beyond length")
        ax.legend(fontsize=8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlim(-0.6, len(table) - 0.4)
    ax.set_xticks(x, table["score"], rotation=30, ha="right")
    ax.set_ylabel(f"LDS ({confidence:.0%} interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_points(points: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    fig = Figure(figsize=(3.2 * len(points), 3.2))
    axes = fig.subplots(1, len(points), squeeze=False)
    for ax, (name, (predicted, measured)) in zip(axes[0], points.items(), strict=True):
        ax.scatter(predicted, measured, s=14)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("predicted (mean over targets)")
    axes[0][0].set_ylabel("measured target loss (mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_outcome(table: pd.DataFrame, path: Path) -> None:
    shown = table[table["selection"] != "random"]
    labels = [s + (f"\n{b} buckets" if b else "") for s, b in zip(shown["selection"], shown["buckets"], strict=True)]
    fig = Figure(figsize=(1.5 + 1.2 * len(shown), 3.4))
    ax = fig.subplots()
    below = np.nan_to_num(np.clip(shown["gain"] - shown["gain_low"], 0, None))
    above = np.nan_to_num(np.clip(shown["gain_high"] - shown["gain"], 0, None))
    ax.bar(range(len(shown)), shown["gain"], yerr=[below, above], capsize=4)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(shown)), labels, rotation=30, ha="right")
    ax.set_ylabel("target loss gain over random")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
