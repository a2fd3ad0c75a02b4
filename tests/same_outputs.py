"""Do two checkouts write the same files? A refactor must not change a byte of what users keep.

    python tests/same_outputs.py model MODEL_DIR          # a tiny random Llama with SmolLM2's tokenizer
    PYTHONPATH=<checkout A> python tests/same_outputs.py write MODEL_DIR A_OUT
    PYTHONPATH=<checkout B> python tests/same_outputs.py write MODEL_DIR B_OUT
    python tests/same_outputs.py compare A_OUT B_OUT      # exit 1 where a file differs

`write` runs one of each command whose file a user keeps: score (with classic scores), align, train
(its monitor and dynamics files) and validate, each on one thread so that the same machine gives the
same numbers. `compare` says, file by file, whether the bytes are equal; where they are not, whether the
values are (Parquet files read without the columns and metadata that record wall time). Run both
checkouts on the same machine: the numbers are those of its BLAS.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROWS = [{"instruction": f"Question {i}: what is {i} plus one?",
         "output": f"It is {i + 1}, of course." + " Yes." * (i % 3)} for i in range(8)]
WALL_TIME = {"seconds"}  # validate's column of a retrain's wall time: the one value that is not a result


def make_model(folder: Path) -> None:
    """The tests' tiny random Llama (2 layers, hidden 64), seeded, beside SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradspec.data.models import load_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         hidden_size=64, intermediate_size=80, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    load_model()[1].save_pretrained(folder)


def write(model: Path, out: Path) -> None:
    """One score, align, train and validate run into out/, each as a user would run it."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from gradspec.cli import main

    # Score files record their inputs' absolute paths: every checkout writes in one folder, then moves it.
    work = Path(tempfile.gettempdir()) / "gradspec-same-outputs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    os.chdir(work)
    Path("train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    Path("task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    common = ["--model", str(model.resolve()), "--data", "train.jsonl", "--quiet"]
    runs = [
        ["score", *common, "--out", "scores.parquet", "--classic"],
        ["align", *common, "--target", "task.jsonl", "--out", "align.parquet"],
        ["train", "--model", str(model.resolve()), "--data", "train.jsonl", "--out", "train", "--epochs", "2",
         "--batch-size", "4", "--learning-rate", "1e-2", "--monitor-every", "2", "--seed", "0"],
        ["validate", *common, "--target", "task.jsonl", "--out", "validate.parquet",
         "--subsets", "4", "--batch-size", "2", "--learning-rate", "1e-3", "--seeds", "1",
         "--outcome", "scores.parquet:nuclear_norm", "--length-buckets", "2"],
    ]
    for args in runs:
        if main(args) != 0:
            sys.exit(f"same_outputs: `gradspec {' '.join(args)}` failed")
    os.chdir(model)
    shutil.move(work, out)


def kept_files(out: Path) -> list[Path]:
    """The files a user keeps: Parquet results and the model's own files (not the inputs written here)."""
    return sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file() and p.suffix != ".jsonl")


def _values(path: Path):
    """A Parquet file's rows and schema without wall time, and its metadata without keys that hold times."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    table = table.drop([c for c in table.column_names if c in WALL_TIME])
    return table.replace_schema_metadata(None), table.schema.metadata


def compare(a: Path, b: Path) -> int:
    """Print one line per file; 1 when any file differs in its values or is on one side only."""
    names = sorted(set(kept_files(a)) | set(kept_files(b)))
    failed = 0
    for name in names:
        left, right = a / name, b / name
        if not (left.exists() and right.exists()):
            print(f"only in {'A' if left.exists() else 'B'}: {name}")
            failed = 1
            continue
        same = hashlib.sha256(left.read_bytes()).digest() == hashlib.sha256(right.read_bytes()).digest()
        if same:
            print(f"same bytes:  {name}")
        elif name.suffix == ".parquet":
            (rows_a, meta_a), (rows_b, meta_b) = _values(left), _values(right)
            if rows_a.equals(rows_b) and meta_a == meta_b:
                print(f"same values: {name} (bytes differ only where wall time is recorded)")
            else:
                print(f"DIFFERENT:   {name}")
                failed = 1
        else:
            print(f"DIFFERENT:   {name}")
            failed = 1
    return failed


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    if command == "model":
        make_model(Path(paths[0]))
    elif command == "write":
        write(Path(paths[0]).resolve(), Path(paths[1]).resolve())
    elif command == "compare":
        sys.exit(compare(Path(paths[0]), Path(paths[1])))
    else:
        sys.exit(__doc__)
