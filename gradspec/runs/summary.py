"""What a finished run says at its end: its rows by status, per module type the means of the main
metrics, where the file is, and the commands that read it next."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd

from gradspec.choices import ALL_ROLES
from gradspec.invocation import program
from gradspec.runs.score_files import complete, read_metadata, read_scores

CLASSIC_SUMMARY = ("perplexity", "ifd", "superfiltering_ifd", "mean_entropy", "token_accuracy")  # of --classic
MAIN_METRICS = ("nuclear_norm", "effective_rank", "spectral_norm", "align_mean", "align_mean_gradient", "align_max")


def module_means(out: str | Path) -> pd.DataFrame:
    """module type x main metric: the mean over complete rows and layers (NaN values skipped)."""
    return _means(*read_scores(out))


def _means(wide: pd.DataFrame, long: pd.DataFrame) -> pd.DataFrame:
    scored = wide.loc[complete(wide["status"]), "index"]
    long = long[long["index"].isin(scored) & long["metric"].isin(MAIN_METRICS)]
    table = long.groupby(["module", "metric"])["value"].mean().unstack("metric")
    order = [r for r in ALL_ROLES if r in table.index] + [r for r in table.index if r not in ALL_ROLES]
    return table.reindex(index=order, columns=[m for m in MAIN_METRICS if m in table.columns])


def written(statuses: Counter[str], where: str | Path) -> str:
    """'wrote 10 rows to where: 9 ok, 1 truncated' ('wrote no rows to where' where there were none)."""
    if not statuses:
        return f"wrote no rows to {where}"
    counts = ", ".join(f"{n} {status}" for status, n in statuses.most_common())
    return f"wrote {sum(statuses.values())} rows to {where}: {counts}"


def _classic(rows: pd.DataFrame) -> list[str]:
    """The --classic scores' medians over complete rows (a perplexity's tail would pull a mean), and how many
    rows have none (an IFD is undefined where the response alone has no loss)."""
    shown = [c for c in CLASSIC_SUMMARY if c in rows.columns]
    if not shown:
        return []
    values = rows[shown].apply(pd.to_numeric, errors="coerce")
    medians = ", ".join(f"{c} {values[c].median():.4g}" for c in shown)
    missing = ", ".join(f"{c} {n}" for c, n in values.isna().sum().items() if n)
    return [f"classic scores, median over complete rows: {medians}"
            + (f" (rows without a value: {missing})" if missing else "")]


def run_summary(out: str | Path) -> str:
    """The lines printed at the end of a run whose output file is written: the file's rows (all of
    them, whichever process or earlier run scored them), their means, the next commands."""
    wide, long = read_scores(out)
    lines = [written(Counter(wide["status"]), out)]
    complete_rows = int(complete(wide["status"]).sum())
    if complete_rows == 0:
        return "\n".join([*lines, "no row was scored: the statuses above say why (docs/inputs.md: malformed rows "
                                  "and statuses)"])
    means = _means(wide, long)
    if not means.empty:
        lines += ["means over complete rows and layers, per module type:",
                  means.rename_axis(index=None, columns=None).to_string(float_format=lambda v: f"{v:.4g}")]
    lines += _classic(wide[complete(wide["status"])])
    meta, command = read_metadata(out), program()
    if "projection" in meta:  # a store: what it is for
        query = f"  {command} align --store {out} --target <task examples> --out aligned.parquet"
        return "\n".join([*lines, "next:", query])
    lines += ["next:", f"  {command} report mine={out} other=<another score file> --out report   # compare two sets"]
    data = meta.get("data")
    by = "alignment" if {"align_mean", "align_mean_gradient"} & set(means.columns) else "effective_rank"
    if data and data != "humaneval" and (by == "alignment" or "effective_rank" in means.columns):
        chosen = f"best{Path(data).suffix}" if Path(data).is_file() else "best.parquet"
        count = max(1, complete_rows // 10)
        lines.append(f"  {command} select --scores {out} --by {by} --count {count} --out {chosen}   # keep the top "
                     f"{count} of {complete_rows} complete rows")
    return "\n".join(lines)
