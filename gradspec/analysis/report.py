"""Comparing groups of scored data: per-layer curves, distributions, effect sizes, correlations.

Each sample is summarised per module type (q, k, v, o, gate, up, down) by the mean of a metric over
layers. Groups are compared with Cohen's d and a Mann-Whitney U test, beside each group's response
length and truncated share and the d left once length is regressed out: where the groups' median
lengths differ by more than LENGTH_RATIO, that length-adjusted d leads, because a spectral metric
mostly follows the token count there. Metrics are correlated
(Spearman) with every numeric column the score files carry, plain and with the response length
partialled out, because effective rank is bounded by the token count and quality labels often
track length.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from scipy import stats  # noqa: E402

from gradspec.data.errors import InputError, check_writable  # noqa: E402
from gradspec.options import OptionError, OptionExists, mention
from gradspec.runs.score_files import complete, read_metadata, read_scores  # noqa: E402

CURVE_METRICS = ("nuclear_norm", "effective_rank")
ROLE_ORDER = ("q", "k", "v", "o", "gate", "up", "down")
LENGTH = "num_response_tokens"
LENGTH_RATIO = 1.5  # groups whose median response lengths differ by more: the length-adjusted d leads
# Columns of a score file that are not sample properties to correlate with.
_NOT_FEATURES = {"index", "status"}


def load_group(label: str, path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(wide, long) of one score file, scored rows only, keyed by `sample` = "label:index", with
    effective_rank_fraction added to long: effective rank / min(T, d_in, d_out), its ceiling, which
    takes out the bound set by length."""
    wide, long = read_scores(path)
    ok = wide.loc[complete(wide["status"]), "index"]
    if not (long["metric"] == "effective_rank").any():
        raise InputError(f"{label}={path}: no spectral metrics (a store from gradspec project, or align without "
                         "--spectra); report compares score files")
    if ok.empty:
        counts = ", ".join(f"{n} {s}" for s, n in wide["status"].value_counts().items())
        raise InputError(f"{label}={path}: no row was scored ({counts})")
    long = long[long["index"].isin(ok)]
    dims = {p["name"]: min(p.get("d_in", np.inf), p.get("d_out", np.inf)) for p in read_metadata(path).get("parts", [])}
    er = long[long["metric"] == "effective_rank"].copy()
    tokens = wide.set_index("index")["num_tokens"]
    er["value"] = er["value"] / np.minimum(er["index"].map(tokens), er["name"].map(dims))
    er["metric"] = "effective_rank_fraction"
    wide, long = wide[complete(wide["status"])].copy(), pd.concat([long, er], ignore_index=True)
    for frame in (wide, long):
        frame["sample"] = label + ":" + frame["index"].astype(str)
    return wide, long


def per_sample(long: pd.DataFrame) -> pd.DataFrame:
    """sample x (metric, module): the mean over layers."""
    return long.groupby(["sample", "metric", "module"])["value"].mean().unstack(["metric", "module"])


def cohens_d(a: np.ndarray, b: np.ndarray) -> float:
    """(mean a - mean b) / pooled standard deviation."""
    na, nb = len(a), len(b)
    pooled = np.sqrt(((na - 1) * a.var(ddof=1) + (nb - 1) * b.var(ddof=1)) / (na + nb - 2))
    return float((a.mean() - b.mean()) / pooled) if pooled > 0 else float("nan")


def group_lengths(wides: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per group: scored rows, response tokens (median, mean) and the share of rows cut at max_length."""
    return pd.DataFrame([{"group": g, "scored rows": len(w), "response tokens, median": w[LENGTH].median(),
                          "response tokens, mean": w[LENGTH].mean(),
                          "truncated": w["status"].str.contains("truncated").mean()} for g, w in wides.items()])


def length_ratio(lengths: pd.DataFrame) -> float:
    """The first two groups' median response lengths, the longer over the shorter (inf where one is 0)."""
    a, b = lengths["response tokens, median"].iloc[:2]
    return max(a, b) / min(a, b) if min(a, b) > 0 else float("inf")


def summary_table(samples: dict[str, pd.DataFrame], wides: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Per metric and module type: each group's mean, and first group vs second (d, Mann-Whitney p; with
    wides, each group's scored rows, also the d of what length leaves: Cohen's d of the metric less its
    slope on log response tokens within the groups, _length_residuals)."""
    labels = list(samples)
    rows = []
    for metric, module in samples[labels[0]].columns:
        row = {"metric": metric, "module": module}
        values = [samples[g][(metric, module)].dropna() for g in labels]
        row.update({f"mean {g}": v.mean() for g, v in zip(labels, values, strict=True)})
        if len(labels) >= 2 and min(len(values[0]), len(values[1])) >= 2:
            row[f"d ({labels[0]} - {labels[1]})"] = cohens_d(values[0].to_numpy(), values[1].to_numpy())
            if wides is not None:
                row["d after length"] = cohens_d(*_length_residuals(values[:2], [wides[g] for g in labels[:2]]))
            row["Mann-Whitney p"] = stats.mannwhitneyu(values[0], values[1]).pvalue
        rows.append(row)
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    return pd.DataFrame(rows).sort_values(["metric", "module"], key=lambda c: c.map(order) if c.name == "module"
                                          else c, ignore_index=True)


def _length_residuals(values: list[pd.Series], wides: list[pd.DataFrame]) -> list[np.ndarray]:
    """Each group's values less what log response tokens explain, by the slope within the groups (ANCOVA:
    metric ~ group + log length): a line pooled over both groups would take a group difference for
    length wherever the groups differ in length. Rows without a length are left out; too few rows: NaN."""
    logs = [np.log(w.set_index("sample")[LENGTH].clip(lower=1)).reindex(v.index).to_numpy() for v, w in
            zip(values, wides, strict=True)]
    kept = [np.isfinite(lg) & np.isfinite(v.to_numpy()) for v, lg in zip(values, logs, strict=True)]
    x = np.concatenate([lg[k] for lg, k in zip(logs, kept, strict=True)])
    y = np.concatenate([v.to_numpy()[k] for v, k in zip(values, kept, strict=True)])
    group = np.concatenate([np.full(int(k.sum()), g, dtype=float) for g, k in enumerate(kept)])
    if min(int(k.sum()) for k in kept) < 2 or len(x) < 4:
        return [np.full(2, np.nan), np.full(2, np.nan)]
    beta, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(x), group, x]), y, rcond=None)
    return [v.to_numpy()[k] - beta[2] * lg[k] for v, lg, k in zip(values, logs, kept, strict=True)]


def _features(wide: pd.DataFrame, samples: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(spectral, other): per-sample metric means over all modules, and the numeric columns carried."""
    spectral = samples.T.groupby(level="metric").mean().T
    numeric = wide.set_index("sample").select_dtypes("number")
    other = numeric[[c for c in numeric.columns if "/" not in c and c not in _NOT_FEATURES]]
    return spectral, other.loc[spectral.index]


def correlations(wide: pd.DataFrame, samples: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Spearman correlations of spectral metrics with the other numeric columns: plain, and with the
    response length partialled out (ranks regressed on the length's rank, residuals correlated)."""
    spectral, other = _features(wide, samples)
    ranks = pd.concat([spectral, other], axis=1).rank()
    plain = ranks.corr().loc[spectral.columns, other.columns]
    length = ranks[LENGTH].to_numpy()
    design = np.column_stack([np.ones_like(length), length])

    def residual(col: pd.Series) -> np.ndarray:
        ok = col.notna().to_numpy()
        out = np.full(len(col), np.nan)
        beta, *_ = np.linalg.lstsq(design[ok], col.to_numpy()[ok], rcond=None)
        out[ok] = col.to_numpy()[ok] - design[ok] @ beta
        return out

    resid = pd.DataFrame({c: residual(ranks[c]) for c in ranks.columns}, index=ranks.index)
    partial = resid.corr().loc[spectral.columns, [c for c in other.columns if c != LENGTH]]
    return plain, partial


def _plot_layer_curves(longs: dict[str, pd.DataFrame], metric: str, path: Path) -> None:
    roles = [r for r in ROLE_ORDER if any(r in set(lg["module"]) for lg in longs.values())]
    fig, axes = plt.subplots(1, len(roles), figsize=(3.2 * len(roles), 3.2), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        for label, long in longs.items():
            sel = long[(long["metric"] == metric) & (long["module"] == role)]
            by_layer = sel.groupby("layer")["value"]
            mean, lo, hi = by_layer.mean(), by_layer.quantile(0.25), by_layer.quantile(0.75)
            ax.plot(mean.index, mean.values, label=label)
            ax.fill_between(mean.index, lo.values, hi.values, alpha=0.2)
        ax.set_title(role)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel(f"{metric} (mean, IQR band)")
    axes[0][-1].legend()
    fig.suptitle(f"{metric} per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_distributions(samples: dict[str, pd.DataFrame], metric: str, path: Path) -> None:
    roles = [r for r in ROLE_ORDER if (metric, r) in next(iter(samples.values())).columns]
    fig, axes = plt.subplots(1, len(roles), figsize=(3.2 * len(roles), 3.2), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        ax.boxplot([s[(metric, role)].dropna() for s in samples.values()], tick_labels=list(samples))
        ax.set_title(role)
    axes[0][0].set_ylabel(f"{metric}, mean over layers")
    fig.suptitle(f"{metric} per sample")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_heatmap(corr: pd.DataFrame, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * corr.shape[1], 1.0 + 0.5 * corr.shape[0]))
    im = ax.imshow(corr.to_numpy(dtype=float), cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set_xticks(range(corr.shape[1]), corr.columns, rotation=45, ha="right")
    ax.set_yticks(range(corr.shape[0]), corr.index)
    for (i, j), v in np.ndenumerate(corr.to_numpy(dtype=float)):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FEW_ROWS = 10  # below this many scored rows in a group, the report says its statistics mean little


def _check_groups(groups: dict[str, str | Path], longs: dict[str, pd.DataFrame]) -> None:
    """The same file twice, or files scored on different module types, cannot be compared."""
    paths: dict[Path, str] = {}
    for label, path in groups.items():
        if Path(path).resolve() in paths:
            raise ValueError(f"{label}={path} is the same file as {paths[Path(path).resolve()]}={path}; compare "
                             "different score files")
        paths[Path(path).resolve()] = label
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    roles = {label: sorted(set(long["module"]), key=lambda r: (order.get(r, len(order)), r))
             for label, long in longs.items()}
    if len({tuple(r) for r in roles.values()}) > 1:
        scored = "; ".join(f"{label} scored {', '.join(r)}" for label, r in roles.items())
        raise ValueError(f"{scored}: a report compares files scored on the same module types; score them with the "
                         "same --modules")


def report_folder(out: str | Path, option: str, overwrite: bool) -> Path:
    """out as a report's folder: refused where it is a file, or a folder not empty without overwrite,
    or not writable; the option names it in the message."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OptionError(option, f"{out} is a file; a report is a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OptionExists(option, f"{out} is a folder that is not empty; pass {mention('overwrite')} or choose "
                           f"another {mention(option)}")
    check_writable(out, option, as_folder=True)
    return out


def write_report(groups: dict[str, str | Path], out: str | Path, overwrite: bool = False) -> Path:
    """Figures and report.md for labelled score files ({"high": path, "low": path, ...})."""
    out = report_folder(out, "out", overwrite)
    loaded = {label: load_group(label, path) for label, path in groups.items()}  # every input checked first
    longs = {label: long for label, (_, long) in loaded.items()}
    _check_groups(groups, longs)
    out.mkdir(parents=True, exist_ok=True)
    samples = {label: per_sample(long) for label, long in longs.items()}
    wides = {label: wide for label, (wide, _) in loaded.items()}
    lengths = group_lengths(wides)
    lines = ["# gradspec report", "", "Groups: " + ", ".join(f"**{g}** ({len(loaded[g][0])} scored rows, `{p}`)"
                                                         for g, p in groups.items()), "",
             lengths.to_markdown(index=False, floatfmt=".3g"), ""]
    ratio = length_ratio(lengths) if len(groups) > 1 else 1.0
    table = summary_table(samples, wides)
    first_d = next((c for c in table.columns if c.startswith("d (")), None)
    if ratio > LENGTH_RATIO and first_d is not None:  # the raw d mostly measures length: the adjusted one leads
        longer, shorter = lengths.sort_values("response tokens, median", ascending=False)["group"].iloc[:2]
        lines += [f"**Length differs:** {longer}'s responses are {ratio:.3g}x as long as {shorter}'s (median "
                  f"response tokens; above {LENGTH_RATIO}x), and a spectral metric follows the token count: "
                  "`d after length` (the metric less its slope on log response tokens within the groups) "
                  f"comes first, before the raw `{first_d}`.", ""]
        table = table[["metric", "module", "d after length", *[c for c in table.columns if c not in
                                                                ("metric", "module", "d after length")]]]
    few = [f"{g} ({len(loaded[g][0])})" for g in groups if len(loaded[g][0]) < FEW_ROWS]
    if few:
        lines += [f"**Few rows:** {', '.join(few)} scored rows; the tests and correlations below mean little "
                  f"under {FEW_ROWS} rows a group (and need 2 a group to be computed at all).", ""]
    for metric in CURVE_METRICS:
        _plot_layer_curves(longs, metric, out / f"layers_{metric}.png")
        _plot_distributions(samples, metric, out / f"distribution_{metric}.png")
        lines += [f"## {metric}", "", f"![per layer](layers_{metric}.png)", "",
                  f"![per sample](distribution_{metric}.png)", ""]
    lines += ["## Summary per module type (mean over layers)", "",
              "Cohen's d > 0 means the first group is higher; `d after length` is Cohen's d of what is left of "
              "the metric once its slope on log response tokens within the groups is taken out (ANCOVA). "
              * (len(groups) > 1)
              + "`effective_rank_fraction` is the effective rank over its ceiling min(T, d_in, d_out), a "
              "length-normalised variant.", "", table.to_markdown(index=False, floatfmt=".3g"), ""]
    wide_all = pd.concat([w for w, _ in loaded.values()], ignore_index=True)
    plain, partial = correlations(wide_all, pd.concat(samples.values()))
    _plot_heatmap(plain, "Spearman correlation, all groups pooled", out / "correlation.png")
    _plot_heatmap(partial, f"... with {LENGTH} partialled out", out / "correlation_partial_length.png")
    lines += ["## Correlations (all groups pooled, Spearman)", "", "![correlation](correlation.png)", "",
              plain.to_markdown(floatfmt=".2f"), "", f"### With the response length ({LENGTH}) partialled out", "",
              "![partial](correlation_partial_length.png)", "", partial.to_markdown(floatfmt=".2f"), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report
