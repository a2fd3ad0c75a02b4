"""Spectra over a training run, as pictures: what a person looks for in a spectral monitor's output.

- ``heatmap_<metric>.png``: per role, layer x monitored step, the mean over the step's samples (and
  over a layer's parts of that role: its experts, say).
- ``roles_<metric>.png``: per role, the mean over layers against the step, with the spread across
  samples (each sample's mean over layers: median, 10-90% band).
- ``moved.png`` and a table in report.md: the samples (by ``sample_index``) whose spectra moved most
  between their first and last monitored step (their mean effective rank over every part).

Only the columns drawn are read, a row group at a time, so a run's whole monitor output fits.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradspec.analysis.report import ROLE_ORDER, report_folder
from gradspec.choices import ALL_ROLES
from gradspec.data.errors import InputError
from gradspec.layers.roles import roles_of
from gradspec.layers.targets import layer_index
from gradspec.runs.score_files import complete, schema_metadata
from gradspec.training.monitor_parts import parts_folder

METRICS = ("effective_rank", "nuclear_norm")
MOVED = 10  # samples listed as having moved most
_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj$")


def is_monitor_output(path: str | Path) -> bool:
    """Whether path is a spectral monitor's output: a Parquet file with a step column, or a folder of them
    (a run's parts, one file per rank), or the file a run not yet closed will write (its parts)."""
    files = _files(Path(path))
    return bool(files) and "step" in ds.dataset(files[0], format="parquet").schema.names


def _files(path: Path) -> list[Path]:
    if not path.exists() and parts_folder(path).is_dir():  # a run not closed: its parts so far
        path = parts_folder(path)
    if path.is_file():
        return [path] if path.suffix == ".parquet" else []
    return sorted(p for p in path.glob("**/*.parquet") if not p.name.startswith("."))


def part_role(name: str, roles: dict[str, str]) -> str:
    """A part's role: as its file records it, else from its name (a fused projection's part ends in its
    role; an expert's in gate_proj, up_proj or down_proj; a router is a module named gate or router)."""
    if name in roles:
        return roles[name]
    expert = _EXPERT.search(name)
    if expert:
        return f"expert_{expert.group(1)}"
    parent, _, leaf = name.rpartition(".")
    if leaf in ALL_ROLES and len(roles_of(parent)) > 1:  # a part of a fused projection (qkv_proj.q)
        return leaf
    if leaf in ("gate", "router"):
        return "router"
    found = roles_of(name)
    return found[0] if len(found) == 1 else "other"


def read_drawn(path: str | Path, metrics: tuple[str, ...] = METRICS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows, parts): each monitored row's step, sample_index and status with its metrics' columns (only
    these read), and one row per part (name, role, layer). path: a monitor file or a folder of them."""
    files = _files(Path(path))
    if not files:
        raise InputError(f"{path}: no Parquet file of a spectral monitor there")
    dataset = ds.dataset([str(f) for f in files], format="parquet")
    names = dataset.schema.names
    if "step" not in names:
        raise InputError(f"{path}: not a spectral monitor's output (no step column); a score file is reported "
                         "as LABEL=SCORES")
    recorded = {p["name"]: p["role"] for p in schema_metadata(dataset.schema).get("parts", [])}  # the first file's
    columns = [c for c in names if "/" in c and c.rsplit("/", 1)[1] in metrics]
    if not columns:
        raise InputError(f"{path}: no {' or '.join(metrics)} column: a monitor run without spectra")
    kept = [c for c in ("step", "micro_batch", "row", "sample_index", "status") if c in names]
    rows = dataset.to_table(columns=kept + columns).to_pandas()
    part_names = sorted({c.rsplit("/", 1)[0] for c in columns})
    parts = pd.DataFrame({"name": part_names, "role": [part_role(n, recorded) for n in part_names],
                          "layer": [layer_index(n) for n in part_names]})
    return rows[complete(rows["status"])] if "status" in rows else rows, parts


def _role_order(roles) -> list[str]:
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    return sorted(set(roles), key=lambda r: (order.get(r, len(order)), r))


def _by_layer(rows: pd.DataFrame, parts: pd.DataFrame, metric: str, role: str) -> pd.DataFrame:
    """Layer x step: the mean over the step's samples and the layer's parts of this role."""
    chosen = parts[parts["role"] == role]
    frame = pd.DataFrame({layer: rows[[f"{n}/{metric}" for n in group["name"]]].mean(axis=1)
                          for layer, group in chosen.groupby("layer")})
    return frame.groupby(rows["step"]).mean().T.sort_index()


def _per_sample(rows: pd.DataFrame, parts: pd.DataFrame, metric: str, role: str) -> pd.Series:
    """Each row's mean over the parts of this role (over layers)."""
    return rows[[f"{n}/{metric}" for n in parts.loc[parts["role"] == role, "name"]]].mean(axis=1)


def _panels(count: int, size: float) -> tuple[Figure, list[Axes]]:
    """A figure of count panels, four to a row; the panels left over hidden."""
    columns = min(4, count)
    rows = -(-count // columns)
    fig = Figure(figsize=(size * columns, size * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _plot_heatmaps(rows: pd.DataFrame, parts: pd.DataFrame, metric: str, path: Path) -> None:
    roles = _role_order(parts["role"])
    fig, axes = _panels(len(roles), 3.4)
    for ax, role in zip(axes, roles, strict=False):
        grid = _by_layer(rows, parts, metric, role)
        steps = grid.columns.to_numpy()
        image = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", origin="lower", interpolation="nearest",
                          extent=(-0.5, len(steps) - 0.5, -0.5, len(grid) - 0.5))
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 6)).round().astype(int))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_yticks(range(len(grid)), [str(layer) for layer in grid.index], fontsize=6)
        ax.set_title(role)
        ax.set_xlabel("step")
        fig.colorbar(image, ax=ax, shrink=0.8)
    axes[0].set_ylabel("layer")
    fig.suptitle(f"{metric}: mean over each step's samples")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_roles(rows: pd.DataFrame, parts: pd.DataFrame, metric: str, path: Path) -> None:
    roles = _role_order(parts["role"])
    fig, axes = _panels(len(roles), 3.2)
    for ax, role in zip(axes, roles, strict=False):
        by_step = _per_sample(rows, parts, metric, role).groupby(rows["step"])
        mean, median = by_step.mean(), by_step.median()
        ax.fill_between(mean.index, by_step.quantile(0.1).values, by_step.quantile(0.9).values, alpha=0.25,
                        label="samples, 10-90%")
        ax.plot(mean.index, mean.values, label="mean")
        ax.plot(median.index, median.values, linestyle="--", label="median")
        ax.set_title(role)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel(f"{metric}, mean over layers")
    axes[len(roles) - 1].legend(fontsize=7)
    fig.suptitle(f"{metric} per role over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def moved_samples(rows: pd.DataFrame, parts: pd.DataFrame, metric: str = "effective_rank",
                  count: int = MOVED) -> pd.DataFrame:
    """The samples monitored at two or more steps whose mean metric over every part changed most from their
    first monitored step to their last: sample_index, first and last step and value, change."""
    if "sample_index" not in rows or rows["sample_index"].isna().all():
        return pd.DataFrame(columns=["sample_index", "first_step", "last_step", "first", "last", "change"])
    value = rows[[f"{n}/{metric}" for n in parts["name"]]].mean(axis=1)
    seen = pd.DataFrame({"sample_index": rows["sample_index"], "step": rows["step"], "value": value}).dropna()
    per_step = seen.groupby(["sample_index", "step"])["value"].mean().reset_index().sort_values("step")
    ends = per_step.groupby("sample_index").agg(first_step=("step", "first"), last_step=("step", "last"),
                                                first=("value", "first"), last=("value", "last"),
                                                steps=("step", "size"))
    ends = ends[ends["steps"] > 1].drop(columns="steps")
    ends["change"] = ends["last"] - ends["first"]
    top = ends.reindex(ends["change"].abs().sort_values(ascending=False).index).head(count)
    return top.reset_index().astype({"sample_index": "int64"})


def _indexed(rows: pd.DataFrame) -> bool:
    return "sample_index" in rows and not rows["sample_index"].isna().all()


def _what_a_step_holds(rows: pd.DataFrame) -> str:
    """What a change between monitored steps compares: each step's own batch, the same samples or others."""
    if not _indexed(rows):
        return ("Each monitored step holds that step's batch; without a sample_index the rows cannot say whether "
                "two steps saw the same samples, so a change between steps may be a change of samples.")
    held = rows.dropna(subset=["sample_index"]).groupby("step")["sample_index"].agg(frozenset)
    pairs = list(zip(held.iloc[:-1], held.iloc[1:], strict=True))
    apart = sum(not (a & b) for a, b in pairs)
    if not pairs or apart == 0:
        return "Each monitored step holds that step's batch; consecutive monitored steps share samples."
    return (f"Each monitored step holds that step's batch: {apart} of {len(pairs)} pairs of consecutive monitored "
            "steps share no sample, so a change between those steps is mostly a change of samples, not of the "
            "model; the samples that moved most (below) follow the same samples.")


def _why_none_moved(rows: pd.DataFrame) -> str:
    """Why no sample's course can be drawn: no index to follow a sample by, or no sample seen twice."""
    if not _indexed(rows):
        return ("No row has a sample_index, so no sample can be followed from step to step (give the rows their "
                "index: gradspec.training.with_sample_index).")
    samples = rows["sample_index"].dropna().nunique()
    return (f"Each of the {samples} samples was monitored at one step only (each seen once, as in one epoch "
            "monitored every few steps): a sample's course needs it monitored at two steps (more epochs, or "
            "monitoring more often).")


def _plot_moved(rows: pd.DataFrame, parts: pd.DataFrame, moved: pd.DataFrame, metric: str, path: Path) -> None:
    value = rows[[f"{n}/{metric}" for n in parts["name"]]].mean(axis=1)
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for index in moved["sample_index"]:
        mine = value[rows["sample_index"] == index].groupby(rows["step"]).mean()
        ax.plot(mine.index, mine.values, marker="o", markersize=3, label=str(index))
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{metric}, mean over parts")
    ax.set_title("the samples whose spectra moved most")
    ax.legend(title="sample_index", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_monitor_report(path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Figures and report.md for a spectral monitor's output (a file, or a folder of parts or rank files)."""
    out = report_folder(out, "out", overwrite)
    rows, parts = read_drawn(path)  # the input checked before anything is written
    if rows.empty:
        raise InputError(f"{path}: no monitored row has spectra (every row is flagged)")
    out.mkdir(parents=True, exist_ok=True)
    metrics = [m for m in METRICS if any(c.endswith(f"/{m}") for c in rows.columns)]
    for metric in metrics:
        _plot_heatmaps(rows, parts, metric, out / f"heatmap_{metric}.png")
        _plot_roles(rows, parts, metric, out / f"roles_{metric}.png")
    steps = sorted(rows["step"].unique())
    lines = ["# gradspec monitor report", "", f"`{path}`: {len(rows)} rows with spectra over {len(steps)} monitored "
             f"steps ({steps[0]} to {steps[-1]}), {len(parts)} parts ({', '.join(_role_order(parts['role']))}).", ""]
    lines += [_what_a_step_holds(rows), ""]
    for metric in metrics:
        lines += [f"## {metric}", "", f"![per layer and step](heatmap_{metric}.png)", "",
                  f"![per role, with the spread across samples](roles_{metric}.png)", ""]
    moved = moved_samples(rows, parts) if "effective_rank" in metrics else pd.DataFrame()
    lines += ["## The samples that moved most", ""]
    if moved.empty:
        lines += [_why_none_moved(rows), ""]
    else:
        _plot_moved(rows, parts, moved, "effective_rank", out / "moved.png")
        lines += ["Mean effective rank over every part, at each sample's first and last monitored step.", "",
                  moved.to_markdown(index=False, floatfmt=".4g"), "", "![their course](moved.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out
