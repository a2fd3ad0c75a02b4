"""The error for bad input: it names the file and the line, row or field."""

import tempfile
from collections.abc import Iterable
from pathlib import Path

from gradspec.errors import InputError, OptionInputError
from gradspec.options import OptionError, mention

__all__ = ["InputError", "OptionInputError", "check_at_least", "check_share", "check_covers", "check_parquet_out",
           "check_writable"]


def check_at_least(values: dict[str, float | None], low: float = 1) -> None:
    """Each option (name -> value; None: not given) is at least low, or an error names it."""
    for name, value in values.items():
        if value is not None and value < low:
            raise OptionError(name, f"must be at least {low}, got {value}")


def check_share(values: dict[str, float | None]) -> None:
    """Each option (name -> value) is a share in [0, 1], or an error names it."""
    for name, value in values.items():
        if value is not None and not 0 <= value <= 1:
            raise OptionError(name, f"must be between 0 and 1, got {value}")


def check_covers(have: Iterable[int], samples: Iterable[int], option: str, path: str | Path) -> None:
    """A file of per-sample evidence (given as option) has a row for every sample index given:
    evidence missing for some is an error, never read as 'none'."""
    wanted = list(samples)
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise OptionInputError(option, f"{path} has no rows for {len(missing)} of the {len(wanted)} samples (the "
                               f"first: index {missing[0]}); pass the file made from this data, or a "
                               f"{mention('limit')} it covers")


def check_parquet_out(path: str | Path, name: str = "out") -> None:
    """An output that names a Parquet file (not a folder, not another format)."""
    if Path(path).suffix != ".parquet" or Path(path).is_dir():
        raise OptionError(name, f"{path}: name a .parquet file to write")


def check_writable(path: str | Path, name: str = "out", as_folder: bool = False) -> None:
    """The nearest existing folder at or above where path goes (path itself for a folder output)
    takes a new file, or an error says so before any work (a file where a folder should be, a
    read-only or virtual file system)."""
    folder = Path(path).absolute() if as_folder else Path(path).absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OptionError(name, f"{path}: {folder} is a file, not a folder; choose another {mention(name)}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise OptionError(name, f"{path}: cannot write in {folder} ({e.strerror}); choose another "
                          f"{mention(name)}") from None
