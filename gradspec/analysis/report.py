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

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from scipy import stats
from tqdm import tqdm

from gradspec.analysis.select import check_status, row_indices
from gradspec.choices import ALL_ROLES, LORA_ROLES, METRICS
from gradspec.data.errors import InputError, check_writable
from gradspec.files import parquet_errors
from gradspec.options import OptionError, OptionExists, mention
from gradspec.runs.score_files import column, complete, read_batches, read_metadata

CURVE_METRICS = ("nuclear_norm", "effective_rank")
FRACTION = "effective_rank_fraction"  # effective rank over its ceiling min(T, d_in, d_out)
QUARTILES = (("lo", 0.25), ("median", 0.5), ("hi", 0.75))  # a layer curve's columns: its band and its middle
CURVE_BYTES = 64 << 20  # about this much of the curves' columns is read at once (whole columns: quantiles)
ROLE_ORDER = (*ALL_ROLES, *LORA_ROLES)  # the per-layer figures' panels: every role a run can score, in this order
LENGTH = "num_response_tokens"
LENGTH_RATIO = 1.5  # groups whose median response lengths differ by more: the length-adjusted d leads
# Columns of a score file that are not sample properties to correlate with.
_NOT_FEATURES = {"index", "status"}
NUMBERS = ("num_tokens", LENGTH)  # beside the modules' metrics, the columns a report reads as numbers
T = TypeVar("T")


@dataclass
class Group:
    """One labelled score file, checked before its modules' columns are read: its metadata, and
    which rows are complete (in file order) and where each goes in the per-sample table (whose rows
    are sorted by their sample name, as per_sample's groupby sorts them); lacking: how many complete rows
    have a metric without a value (NaN or inf, left out of the means), counted by load_group."""

    label: str
    path: str | Path
    meta: dict[str, Any]
    scored: np.ndarray
    samples: pd.Index
    place: np.ndarray
    lacking: int = 0

    @property
    def roles(self) -> set[str]:
        return {p["role"] for p in self.meta["parts"]}


def check_group(label: str, path: str | Path, progress: bool = False) -> Group:
    """A score file checked as a report's group, from its metadata and its index and status columns
    only: it has spectral metrics and a scored row."""
    meta = read_metadata(path)
    parts, metrics = meta.get("parts", []), meta.get("metrics", list(METRICS))
    with parquet_errors(path):
        file = pq.ParquetFile(path)
        schema = file.schema_arrow
        if "index" not in schema.names:
            raise InputError(f"{path}: no index column (the input row of each score); pass a file gradspec wrote")
        rows = pa.concat_tables(read_batches(file, ["index", "status"], progress, f"checking {label}")).to_pandas()
    if not parts or "effective_rank" not in metrics or rows.empty:
        raise InputError(f"{label}={path}: no spectral metrics (a store from gradspec project, or align without "
                         "--spectra); report compares score files")
    check_status(path, rows)
    row_indices(path, rows)
    needed = [*NUMBERS, *(column(p["name"], m) for p in parts for m in metrics)]
    odd = next((c for c in needed if c not in schema.names or not _numeric(schema.field(c).type)), None)
    if odd is not None:
        held = f"holds {schema.field(odd).type}, not numbers" if odd in schema.names else "is missing"
        raise InputError(f"{label}={path}: its column {odd!r} {held}; pass a file gradspec score wrote")
    ok = complete(rows["status"]).to_numpy(dtype=bool)
    if not ok.any():
        counts = ", ".join(f"{n} {s}" for s, n in rows["status"].value_counts().items())
        raise InputError(f"{label}={path}: no row was scored ({counts})")
    names = label + ":" + rows.loc[ok, "index"].astype(str)
    order = np.argsort(names.to_numpy(dtype=object), kind="stable")
    place = np.empty(len(order), dtype=np.int64)
    place[order] = np.arange(len(order))
    return Group(label, path, meta, ok, pd.Index(names.to_numpy(dtype=object)[order], name="sample"), place)


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_null(kind)


def load_group(group: Group, progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(wide, samples, curves) of a group's scored rows, from one read of its file in batches of rows
    and one of its curve columns (layer_curves): wide is its columns other than the modules', keyed by
    `sample` = "label:index" (a text column empty: only numbers are compared), samples per_sample's
    table, with effective_rank_fraction: effective rank / min(T, d_in, d_out), its ceiling, which takes
    out the bound set by length."""
    with parquet_errors(group.path):
        return _load_group(group, progress)


def _load_group(group: Group, progress: bool) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    schema = pq.read_schema(group.path)
    parts = sorted(group.meta["parts"], key=lambda p: p["layer"])  # a layer's parts in file order, as long's sort
    metrics = group.meta.get("metrics", list(METRICS))
    keys = sorted((m, r) for m in [*metrics, FRACTION] for r in group.roles)
    dims = {p["name"]: min(p.get("d_in", np.inf), p.get("d_out", np.inf)) for p in parts}
    # per metric: its keys' positions, its parts (by module type, layer) and their keys' codes
    blocks = []
    for metric in dict.fromkeys(m for m, _ in keys):
        mine = [i for i, (m, _) in enumerate(keys) if m == metric]
        sources = [(i - mine[0], p) for i in mine for p in parts if p["role"] == keys[i][1]]
        codes = np.array([c for c, _ in sources])
        blocks.append((metric, slice(mine[0], mine[-1] + 1), [p for _, p in sources], codes))
    numeric = set(schema.empty_table().to_pandas().select_dtypes("number").columns)
    others = [c for c in schema.names if "/" not in c]
    read = [c for c in others if c in numeric or c in ("index", "status", "num_tokens", LENGTH)]
    modules = [column(p["name"], m) for p in parts for m in metrics]
    means = np.empty((len(group.samples), len(keys)))
    lacking = np.zeros(len(group.samples), dtype=bool)
    kept, done = [], 0
    for table in read_batches(group.path, read + modules, progress, f"reading {group.label}"):
        ok = complete(table.column("status").to_pandas()).to_numpy(dtype=bool)
        at = {name: i for i, name in enumerate(table.column_names)}  # (a lookup by name scans every column)
        tokens = table.column(at["num_tokens"]).to_numpy(zero_copy_only=False)
        rows = group.place[done:done + int(ok.sum())]
        for metric, keyed, sources, codes in blocks:
            values = np.empty((len(sources), table.num_rows))  # a part a row: each column of the file is one
            for j, p in enumerate(sources):
                if metric == FRACTION:
                    values[j] = _floats(table, at[column(p["name"], "effective_rank")])
                    values[j] /= np.minimum(tokens, dims[p["name"]])
                else:
                    values[j] = _floats(table, at[column(p["name"], metric)])
            _without_inf(values)
            if metric != FRACTION:  # a metric of the file's (not one derived here from two)
                lacking[rows] |= np.isnan(values[:, ok]).any(0)
            # per_sample's mean (a groupby's: NaN skipped, NaN where all are), of each sample's values at once
            means[rows, keyed] = pd.DataFrame(values[:, ok]).groupby(codes).mean().to_numpy().T
        done += len(rows)
        kept.append(table.select(read).filter(pa.array(ok)))
    samples = pd.DataFrame(means, index=group.samples, copy=False,
                           columns=pd.MultiIndex.from_tuples(keys, names=["metric", "module"]))
    wide = pa.concat_tables(kept).to_pandas()
    for c in others:
        if c not in read:  # in the report's pooled table it is not a number, whatever the other groups hold there
            wide[c] = pd.Series(None, index=wide.index, dtype=object)
    wide = wide[others]
    wide["sample"] = group.label + ":" + wide["index"].astype(str)
    group.lacking = int(lacking.sum())
    return wide, samples, layer_curves(group, progress)


def layer_curves(group: Group, progress: bool = False) -> dict[tuple[str, str], pd.DataFrame]:
    """Per (metric, module type) of CURVE_METRICS: per layer, the median and the quartiles of the metric
    over the scored rows and the layer's parts of that type (a mean can lie outside its own quartiles, as a
    skewed metric's does: a curve drawn in its band is the band's middle). Quantiles need whole columns: they are read a
    few at a time (CURVE_BYTES), each layer's columns together."""
    metrics = group.meta.get("metrics", list(METRICS))
    layers: dict[tuple[str, str, int], list[str]] = {}
    for metric in CURVE_METRICS:
        for role in ROLE_ORDER:
            for p in sorted(group.meta["parts"], key=lambda p: p["layer"]):
                if p["role"] == role and metric in metrics:
                    layers.setdefault((metric, role, p["layer"]), []).append(column(p["name"], metric))
    file, rows = pq.ParquetFile(group.path), int(group.scored.size)
    found: dict[tuple[str, str], list[pd.DataFrame]] = {(m, r): [] for m in CURVE_METRICS for r in ROLE_ORDER
                                                         if r in group.roles}
    ok = group.scored
    with tqdm(total=sum(map(len, layers.values())), desc=f"layer curves {group.label}", unit="column",
              disable=not progress, dynamic_ncols=True) as bar:
        for keys in _bounded(layers, lambda k: len(layers[k]), max(1, CURVE_BYTES // (8 * max(1, rows)))):
            table = file.read(columns=[c for k in keys for c in layers[k]])
            for metric, role, layer in keys:
                # the layer's values (by row, then part), through the groupby of the long form's curves
                values = _without_inf(np.column_stack([_floats(table, c)[ok] for c in layers[(metric, role, layer)]])
                                      .ravel())
                by_layer = pd.Series(values).groupby(np.full(len(values), layer))
                quartiles = by_layer.quantile([0.25, 0.5, 0.75])  # one sort for the three
                found[(metric, role)].append(pd.DataFrame({q: quartiles.xs(at, level=1) for q, at in QUARTILES}))
                bar.update(len(layers[(metric, role, layer)]))
    empty = pd.DataFrame({q: [] for q, _ in QUARTILES}, dtype=float)
    return {key: pd.concat(frames) if frames else empty for key, frames in found.items()}


def _bounded(items: Iterable[T], size: Callable[[T], int], most: int) -> Iterator[list[T]]:
    """items in consecutive lists whose sizes add up to at most `most` (an item larger: alone)."""
    chunk: list[T] = []
    total = 0
    for item in items:
        if chunk and total + size(item) > most:
            yield chunk
            chunk, total = [], 0
        chunk.append(item)
        total += size(item)
    if chunk:
        yield chunk


def _floats(table: pa.Table, name: str | int) -> np.ndarray:
    """A column (by name or position) as float64, nulls as NaN (a column of only nulls too)."""
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=float)


def _without_inf(values: np.ndarray) -> np.ndarray:
    """values with inf as NaN, in place: no value, left out of a mean or a quantile as NaN is."""
    values[np.isinf(values)] = np.nan
    return values


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
    # each sample's log response tokens, looked up once (not for every metric: a million names each time)
    lengths = {g: np.log(wides[g].set_index("sample")[LENGTH].clip(lower=1)).reindex(samples[g].index)
               for g in labels[:2]} if wides is not None and len(labels) >= 2 else None
    rows = []
    for metric, module in samples[labels[0]].columns:
        row = {"metric": metric, "module": module}
        values = [samples[g][(metric, module)].dropna() for g in labels]
        row.update({f"mean {g}": v.mean() for g, v in zip(labels, values, strict=True)})
        if len(labels) >= 2 and min(len(values[0]), len(values[1])) >= 2:
            row[f"d ({labels[0]} - {labels[1]})"] = cohens_d(values[0].to_numpy(), values[1].to_numpy())
            if lengths is not None:
                logs = [lengths[g][samples[g][(metric, module)].notna()] for g in labels[:2]]
                row["d after length"] = cohens_d(*_length_residuals(values[:2], logs))
            row["Mann-Whitney p"] = stats.mannwhitneyu(values[0], values[1]).pvalue
        rows.append(row)
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    return pd.DataFrame(rows).sort_values(["metric", "module"], key=lambda c: c.map(order) if c.name == "module"
                                          else c, ignore_index=True)


def _length_residuals(values: list[pd.Series], lengths: list[pd.Series]) -> list[np.ndarray]:
    """Each group's values less what log response tokens (lengths: of the same rows) explain, by the slope
    within the groups (ANCOVA: metric ~ group + log length): a line pooled over both groups would take a
    group difference for length wherever the groups differ in length. Rows without a length are left out;
    too few rows: NaN."""
    logs = [lg.to_numpy() for lg in lengths]
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


def metric_means(samples: pd.DataFrame) -> pd.DataFrame:
    """per_sample's table with each metric's mean over module types (_features'), as one column (metric,
    "all"): what correlations reads of it, a seventh of its size, to pool a group's with the others'. A
    sample's means are its own: they are taken 100,000 samples at a time (the groupby copies them)."""
    means = pd.concat([samples.iloc[i:i + 100_000].T.groupby(level="metric").mean().T
                       for i in range(0, max(len(samples), 1), 100_000)])
    means.columns = pd.MultiIndex.from_tuples([(m, "all") for m in means.columns], names=["metric", "module"])
    return means


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


def _plot_layer_curves(curves: dict[str, dict[tuple[str, str], pd.DataFrame]], metric: str, path: Path) -> None:
    roles = [r for r in ROLE_ORDER if any((metric, r) in c for c in curves.values())]
    fig = Figure(figsize=(3.2 * len(roles), 3.2))
    axes = fig.subplots(1, len(roles), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        for label, found in curves.items():
            by_layer = found[(metric, role)]
            ax.plot(by_layer.index, by_layer["median"].values, label=label)
            ax.fill_between(by_layer.index, by_layer["lo"].values, by_layer["hi"].values, alpha=0.2)
        ax.set_title(role)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel(f"{metric} (median, IQR band)")
    axes[0][-1].legend()
    fig.suptitle(f"{metric} per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_distributions(samples: dict[str, pd.DataFrame], metric: str, path: Path) -> None:
    roles = [r for r in ROLE_ORDER if (metric, r) in next(iter(samples.values())).columns]
    fig = Figure(figsize=(3.2 * len(roles), 3.2))
    axes = fig.subplots(1, len(roles), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        ax.boxplot([s[(metric, role)].dropna() for s in samples.values()], tick_labels=list(samples))
        ax.set_title(role)
    axes[0][0].set_ylabel(f"{metric}, mean over layers")
    fig.suptitle(f"{metric} per sample")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def text_color(rgba: tuple[float, ...]) -> str:
    """White on a dark cell, black on a light one: by the cell's relative luminance (WCAG's weights)."""
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3])
    return "white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.179 else "black"


def _plot_heatmap(corr: pd.DataFrame, title: str, path: Path) -> None:
    """Cells sized to their numbers, each number white on a dark cell and black on a light one, and the
    figure cut to what it draws (bbox_inches="tight": no margin a square image leaves in a wide figure)."""
    values = corr.to_numpy(dtype=float)
    fig = Figure(figsize=(1.5 + 0.55 * corr.shape[1], 1.0 + 0.45 * corr.shape[0]))
    ax = fig.subplots()
    im = ax.imshow(values, cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set_xticks(range(corr.shape[1]), corr.columns, rotation=45, ha="right")
    ax.set_yticks(range(corr.shape[0]), corr.index)
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, "n/a" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                color="black" if np.isnan(v) else text_color(im.cmap(im.norm(v))))  # NaN: a blank cell
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax.set_title(title)
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.05)


FEW_ROWS = 10  # below this many scored rows in a group, the report says its statistics mean little


def _check_groups(groups: dict[str, str | Path], scored: dict[str, set[str]]) -> None:
    """The same file twice, or files scored on different module types (scored: each label's), cannot be
    compared."""
    paths: dict[Path, str] = {}
    for label, path in groups.items():
        if Path(path).resolve() in paths:
            raise ValueError(f"{label}={path} is the same file as {paths[Path(path).resolve()]}={path}; compare "
                             "different score files")
        paths[Path(path).resolve()] = label
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    roles = {label: sorted(found, key=lambda r: (order.get(r, len(order)), r)) for label, found in scored.items()}
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


def write_report(groups: dict[str, str | Path], out: str | Path, overwrite: bool = False,
                 progress: bool = False) -> Path:
    """Figures and report.md for labelled score files ({"high": path, "low": path, ...}). Every input is
    checked before any file's module columns are read; those are read in batches (load_group)."""
    out = report_folder(out, "out", overwrite)
    checked = {label: check_group(label, path, progress) for label, path in groups.items()}
    _check_groups(groups, {label: group.roles for label, group in checked.items()})
    out.mkdir(parents=True, exist_ok=True)
    wides, samples, curves = {}, {}, {}
    for label, group in checked.items():
        wides[label], samples[label], curves[label] = load_group(group, progress)
    lengths = group_lengths(wides)
    lines = ["# gradspec report", "", "Groups: " + ", ".join(f"**{g}** ({len(wides[g])} scored rows, `{p}`)"
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
    lacking = [f"{g} ({checked[g].lacking} of {len(wides[g])})" for g in groups if checked[g].lacking]
    if lacking:
        lines += [f"**Missing values:** scored rows with a metric of some module NaN or inf: {', '.join(lacking)}; "
                  "each such value is left out of the means (an MoE expert a row did not reach has none).", ""]
    few = [f"{g} ({len(wides[g])})" for g in groups if len(wides[g]) < FEW_ROWS]
    if few:
        lines += [f"**Few rows:** {', '.join(few)} scored rows; the tests and correlations below mean little "
                  f"under {FEW_ROWS} rows a group (and need 2 a group to be computed at all).", ""]
    for metric in CURVE_METRICS:
        _plot_layer_curves(curves, metric, out / f"layers_{metric}.png")
        _plot_distributions(samples, metric, out / f"distribution_{metric}.png")
        lines += [f"## {metric}", "", f"![per layer](layers_{metric}.png)", "",
                  f"![per sample](distribution_{metric}.png)", ""]
    lines += ["## Summary per module type (mean over layers)", "",
              "Cohen's d > 0 means the first group is higher; `d after length` is Cohen's d of what is left of "
              "the metric once its slope on log response tokens within the groups is taken out (ANCOVA). "
              * (len(groups) > 1)
              + "`effective_rank_fraction` is the effective rank over its ceiling min(T, d_in, d_out), a "
              "length-normalised variant.", "", table.to_markdown(index=False, floatfmt=".3g"), ""]
    wide_all = pd.concat(wides.values(), ignore_index=True)
    pooled = pd.concat([metric_means(samples.pop(label)) for label in list(samples)])  # 400 MB a million rows:
    plain, partial = correlations(wide_all, pooled)  # each group's table goes before correlations takes its own
    _plot_heatmap(plain, "Spearman correlation, all groups pooled", out / "correlation.png")
    _plot_heatmap(partial, f"... with {LENGTH} partialled out", out / "correlation_partial_length.png")
    lines += ["## Correlations (all groups pooled, Spearman)", "", "![correlation](correlation.png)", "",
              plain.to_markdown(floatfmt=".2f"), "", f"### With the response length ({LENGTH}) partialled out", "",
              "![partial](correlation_partial_length.png)", "", partial.to_markdown(floatfmt=".2f"), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report
