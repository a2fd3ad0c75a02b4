"""Selecting data by its scores, written back in the input's own format.

A criterion is a column of the score file (``model.layers.3.self_attn.q_proj/effective_rank``),
a metric name (``effective_rank``: the mean over every scored module), a classic score (``ifd``),
``alignment`` (the whole model's cosine with a task, from `gradspec align`),
or a weighted combination of these, each standardised first (``effective_rank:1,nuclear_norm:-1``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradspec.data.errors import InputError, check_at_least
from gradspec.data.formats import read_records
from gradspec.data.hub import Hub
from gradspec.data.in_memory import plain_value
from gradspec.files import atomic_write, parquet_errors, regular
from gradspec.options import OptionError
from gradspec.runs.score_files import (
    complete,
    module_columns,
    module_mean,
    read_batches,
    write_parquet,
)

ALIGNMENT_COLUMNS = ("align_mean", "align_mean_gradient", "align_max")  # what "alignment" means, by preference
# Flags that one score of a row is undefined (its spectra are whole): they keep the row out of a selection only
# where the criterion reads that score (a name starting so)
UNDEFINED = {"ifd_undefined": ("ifd",), "alignment_undefined": ("alignment", "align_")}

log = logging.getLogger("gradspec")


def competing(scores: pd.DataFrame, by: str) -> pd.Series:
    """The rows that compete under criterion by: complete ones (score_files.complete), flags of an undefined
    score that by does not read (UNDEFINED) aside."""
    names = [name for name, _ in criteria(by)]
    unread = {flag for flag, starts in UNDEFINED.items() if not any(n.startswith(starts) for n in names)}
    return complete(scores["status"].str.split(";").map(lambda flags: ";".join(f for f in flags if f not in unread)
                                                      or "ok"))


def criterion_values(scores: pd.DataFrame, name: str) -> pd.Series:
    """One named criterion per row: a column, a metric averaged over all modules, or "alignment":
    the whole model's cosine with a task from `gradspec align` (the mean over its examples, LESS's
    choice, else the cosine with their mean gradient, else the max)."""
    if name == "alignment":
        found = [c for c in ALIGNMENT_COLUMNS if c in scores.columns]
        if not found:
            raise OptionError("by", "alignment needs a score file from `gradspec align` (columns align_*)")
        name = found[0]
    if name in ("index", "status"):
        raise OptionError("by", f"{name}: the row's {'position' if name == 'index' else 'flags'}, not a score; "
                         "choose a metric or a numeric column")
    if name in scores.columns:
        if not pd.api.types.is_numeric_dtype(scores[name]):
            raise OptionError("by", f"{name}: not a numeric column; choose a metric or a numeric column")
        return scores[name].astype(float)
    columns = module_columns(scores.columns, name)
    if not columns:
        metrics = sorted({c.rsplit("/", 1)[1] for c in scores.columns if "/" in c})
        if not metrics:
            raise OptionError("by", f"{name}: the score file has no per-module metrics (a store from gradspec project, "
                             "or align without --spectra); choose a column, or score with spectra")
        raise OptionError((), f"unknown criterion {name!r}: not a column, and no module has it; metrics: {metrics}")
    odd = next((c for c in columns if not pd.api.types.is_numeric_dtype(scores[c])), None)
    if odd is not None:
        raise OptionError("by", f"{name}: its module column {odd!r} is not numeric (a file gradspec did not write?)")
    return module_mean(scores, name)


def criteria(by: str) -> list[tuple[str, float]]:
    """'a' or 'a:w1,b:w2' -> [(name, weight)]."""
    out = []
    for term in (t.strip() for t in by.split(",") if t.strip()):
        name, colon, weight = (part.strip() for part in term.partition(":"))
        if not name:
            raise OptionError("by", f"{by!r}: {term!r} names no criterion")
        try:
            value = float(weight) if colon else 1.0
        except ValueError:
            raise OptionError("by", f"{by!r}: weight {weight!r} of {name!r} is not a number") from None
        if not np.isfinite(value):
            raise OptionError("by", f"{by!r}: weight {weight!r} of {name!r} is not a finite number")
        out.append((name, value))
    if not out:
        raise OptionError("by", "names no criterion")
    return out


def combined_score(scores: pd.DataFrame, by: str) -> pd.Series:
    """A single criterion as is; a combination as the weighted sum of z-scores."""
    terms = criteria(by)
    if len(terms) == 1 and ":" not in by:
        return criterion_values(scores, terms[0][0])
    total = pd.Series(0.0, index=scores.index)
    for name, weight in terms:
        values = criterion_values(scores, name)
        values = values.where(np.isfinite(values))  # inf: no value, as NaN (it would make every z-score NaN)
        total += weight * (values - values.mean()) / (values.std(ddof=0) or 1.0)
    return total


def choose(
    scores: pd.DataFrame, by: str, top: bool = True, fraction: float | None = None, count: int | None = None,
    length_buckets: int = 0,
) -> pd.DataFrame:
    """The chosen rows of a score table (the rows that compete: ``competing``), with their selection score in
    ``gradspec_score``: exactly count rows (or the fraction of the competing rows, rounded), or every
    competing row where there are fewer (said in the log). A competing row without a finite score (an expert
    it did not reach) does not compete; ``attrs["valued"]`` says how many rows had one.

    With length_buckets > 0 the rows are shared out over quantile buckets of num_tokens, so that a criterion
    correlated with length does not select by length alone (balanced_order).
    """
    check_size(fraction, count, length_buckets)
    ok = scores[competing(scores, by)].copy()
    for name, _ in criteria(by):
        if name not in ok.columns:
            ok[name] = criterion_values(ok, name)
    ok["gradspec_score"] = combined_score(ok, by)
    ok = ok[np.isfinite(ok["gradspec_score"])]
    wanted = min(len(ok), count if count is not None else int(round(fraction * len(ok))))
    if count is not None and count > len(ok) > 0:
        log.warning("--count %d: only %d rows compete (complete, with a finite %s); all %d are chosen", count, len(ok),
                    by, len(ok))
    if wanted == 0:
        name, value = ("fraction", fraction) if fraction is not None else ("count", count)
        raise OptionError(name, f"{value} of {len(ok)} complete rows selects none; ask for more")
    ranked = ok.sort_values("gradspec_score", ascending=not top, kind="stable")
    if length_buckets > 0:
        ranked = balanced_order(ranked, min(length_buckets, len(ok)))
    chosen = ranked.head(wanted).sort_values("index")
    chosen.attrs["valued"] = len(ok)
    return chosen


def check_size(fraction: float | None, count: int | None, length_buckets: int = 0) -> None:
    """How many rows choose is asked for, checked before any row is read."""
    if (fraction is None) == (count is None):
        raise OptionError(("fraction", "count"), ": give exactly one of them")
    if fraction is not None and not 0 < fraction <= 1:
        raise OptionError("fraction", f"must be in (0, 1], got {fraction}")
    check_at_least({"count": count})
    if length_buckets < 0:
        raise OptionError("length_buckets", f"must be 0 (none) or more, got {length_buckets}")


def row_indices(path: str | Path, frame: pd.DataFrame, rows: int | None = None, of: str = "input") -> np.ndarray:
    """A score file's index column (the input row each of its rows scored) as row numbers, checked: whole
    numbers, none missing, each once, from 0 (below rows, the count of the input, of, where known); else an
    InputError naming the file and the first that is not."""
    if "index" not in frame.columns:
        raise InputError(f"{path}: no index column (the input row of each score); pass a file gradspec wrote")
    index = frame["index"]
    if index.isna().any():
        raise InputError(f"{path}: row {int(np.flatnonzero(index.isna())[0])} has no index (the input row it "
                         "scored); pass a file gradspec wrote")
    if len(index) and not pd.api.types.is_integer_dtype(index):
        kind = type(index.iloc[0]).__name__ if index.dtype == object else index.dtype
        raise InputError(f"{path}: its index holds {kind} values, not row numbers; pass a file gradspec wrote")
    values = index.to_numpy(dtype=np.int64)
    outside = values < 0 if rows is None else (values < 0) | (values >= rows)
    if outside.any():
        rows_of = of if rows is None else f"{rows}-row {of}"
        raise InputError(f"{path}: index {values[outside.argmax()]} is not a row of the {rows_of}; pass the scores "
                         "of that data")
    repeated = index.duplicated().to_numpy()
    if repeated.any():
        raise InputError(f"{path}: index {values[repeated.argmax()]} is given twice (each input row has one score); "
                         "pass a file gradspec wrote")
    return values


def check_status(path: str | Path, frame: pd.DataFrame) -> None:
    """A score file's status column (each row's flags: which rows are complete), checked to hold text."""
    if "status" not in frame.columns:
        raise InputError(f"{path}: no status column (which rows were scored); pass a file gradspec wrote")
    status = frame["status"]
    if pd.api.types.is_string_dtype(status) and not status.isna().any():
        return
    row = int(status.map(lambda s: not isinstance(s, str)).to_numpy(dtype=bool).argmax())
    raise InputError(f"{path}: row {row} has status {status.iloc[row]}, not its flags as text; pass a file "
                     "gradspec wrote")


def check_criteria(schema: pa.Schema, by: str) -> None:
    """by's criteria checked against a score file's columns (its schema: a table of no rows) before
    any row is read: an unknown name, or a column that is not a score, is named at once."""
    empty = schema.empty_table().to_pandas()
    for name, _ in criteria(by):
        criterion_values(empty, name)


def read_criteria(path: str | Path, by: str, progress: bool = False) -> pd.DataFrame:
    """The part of a score file that choose and write_selection read for criterion by: index, status,
    loss, num_tokens, and each criterion's column, or for a metric its mean over modules (in a column
    of the metric's name, as choose adds it, for the rows that compete). Only those columns are read, a
    batch of rows at a time, so a metric's 224 module columns of a million rows are never in memory
    together."""
    with parquet_errors(path):
        return _read_criteria(path, pq.ParquetFile(regular(path, "pass a score file")), by, progress)


def _read_criteria(path: str | Path, file: pq.ParquetFile, by: str, progress: bool) -> pd.DataFrame:
    names = file.schema_arrow.names
    wanted = [c for c in ("index", "status", "loss", "num_tokens") if c in names]
    metrics = {}
    for name, _ in criteria(by):
        if name == "alignment":  # what criterion_values reads for it
            wanted += [c for c in ALIGNMENT_COLUMNS if c in names][:1]
        if name in names:
            wanted.append(name)
        elif name != "alignment":
            metrics[name] = module_columns(names, name)
    needed = set(wanted).union(*metrics.values())
    frames, means, few, done = [], {name: [] for name in metrics}, {name: [] for name in metrics}, 0
    for table in read_batches(file, [c for c in names if c in needed], progress, f"reading {Path(path).name}"):
        frame = table.to_pandas()
        check_status(path, frame)
        competes = competing(frame, by).to_numpy(dtype=bool)
        for name, columns in metrics.items():
            block = frame.loc[competes, columns]
            means[name].append((done + np.flatnonzero(competes), _module_means(block, name)))
            if sum(len(b) for b in few[name]) < SUMMED_ALONG:
                few[name].append(block)
        # a copy: a selection of columns is a view that would keep the whole batch in memory
        frames.append(frame[list(dict.fromkeys(wanted))].copy())
        done += len(frame)
    scores = pd.concat(frames, ignore_index=True)
    row_indices(path, scores)
    for name, batches in means.items():  # the competing rows' means: choose reads no other
        values = np.full(len(scores), np.nan)
        for rows, found in batches:
            values[rows] = found
        if sum(len(b) for b in few[name]) < SUMMED_ALONG:  # choose's frame had too few rows for that order
            values[np.concatenate([rows for rows, _ in batches])] = module_mean(pd.concat(few[name]), name)
        scores[name] = values
    return scores


# pandas (3.0) sums a frame of this many rows or more along its columns, in their order, whatever else it holds;
# a frame of fewer rows in another order, which can change a mean's last bit
SUMMED_ALONG = 6


def _module_means(block: pd.DataFrame, name: str) -> np.ndarray:
    """module_mean of a batch's rows as choose computed it from the frame of every competing row (of
    SUMMED_ALONG rows or more): a batch of fewer rows is summed beside rows of NaN."""
    missing = max(0, SUMMED_ALONG - len(block))
    padded = pd.concat([block, pd.DataFrame(np.nan, index=range(missing), columns=block.columns)]) if missing \
        else block
    return module_mean(padded, name).to_numpy()[:len(block)]


def balanced_order(ranked: pd.DataFrame, buckets: int) -> pd.DataFrame:
    """Rows ranked best first, reordered as a draft over length buckets: every bucket's best row, then every
    bucket's second best, and so on, each round in score order. Any head of it keeps the buckets within one
    row of each other (a bucket that runs out leaves its share to the others), the odd rows going to the best
    of each round: the rounding of a count over buckets loses no row."""
    by_length = ranked["num_tokens"].sort_index().rank(method="first")  # ties in input order
    bucket = pd.qcut(by_length, buckets, labels=False)
    place = ranked.groupby(bucket, sort=False).cumcount()  # 0: the best of its bucket
    return ranked.iloc[np.argsort(place.to_numpy(), kind="stable")]


OUTPUT_FORMATS = (".jsonl", ".json", ".parquet", "")  # "": a datasets folder (save_to_disk)


def check_output(out: str | Path) -> None:
    """out names a format write_selection writes (checked before any row is read)."""
    if Path(out).suffix not in OUTPUT_FORMATS:
        raise OptionError("out", f"{out}: write .jsonl, .json, .parquet, or a name without a suffix "
                          "for a datasets folder")


def write_selection(data: str | Path, chosen: pd.DataFrame, out: str | Path, columns: list[str],
                    hub: Hub = Hub()) -> int:
    """Writes the chosen input records, in input order, with the given score columns added, in the
    format out's name asks for (a name without a suffix: a datasets folder); returns how many."""
    out = Path(out)
    check_output(out)
    columns = list(dict.fromkeys(columns))  # a criterion may be one of the columns always written (loss)
    extra = chosen.set_index("index")[columns]
    records, seen = [], 0
    for index, (_, record) in enumerate(read_records(data, wanted=extra.index.__contains__, hub=hub)):
        seen = index + 1
        if isinstance(record, InputError):
            raise record
        if record is not None and index in extra.index:
            record.update({c: plain_value(extra.at[index, c]) for c in columns})  # each column's own type
            records.append(record)
    if len(records) != len(extra):
        raise InputError(f"{data}: has {seen} records; the score file names rows beyond them (another input?)")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix in (".parquet", ""):
        columns_of = {k: [r.get(k) for r in records] for k in dict.fromkeys(k for r in records for k in r)}
        if out.suffix == "":
            import datasets

            datasets.Dataset.from_dict(columns_of).save_to_disk(str(out))
        else:
            import pyarrow as pa

            write_parquet(pa.table(columns_of), out)
    else:
        text = "".join(_json(r) + "\n" for r in records) if out.suffix == ".jsonl" else _json(records, indent=1)
        atomic_write(out, lambda f: f.write(text.encode("utf-8")))
    return len(records)


def _json(value, indent: int | None = None) -> str:
    """JSON text with its characters as they are, or escaped where UTF-8 cannot hold them (a lone
    surrogate in a column gradspec does not read), so that writing the selection cannot fail on them."""
    text = json.dumps(value, ensure_ascii=False, indent=indent, default=plain_value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, indent=indent, default=plain_value)
    return text
