"""The run folder of a scoring run: a manifest, one Parquet part per chunk of input rows, and the
locks of the processes that work in it.

Rows are scored in chunks of consecutive input indices; a chunk's part is written to a temporary
file and renamed, so a part either exists whole or not at all, and a killed run resumes by skipping
the chunks whose part exists. Shards own chunks round-robin, so any number of processes can share
one folder. Merging writes the parts, in input order, into one file.

Each part records its run's config fingerprint (config_fingerprint: a hash of the manifest's config,
which holds a fingerprint of the model's files beside their resolved folder, recorded but not
compared) and the rows it holds (part: chunk, first_row, last_row). A resume and a merge refuse a
part of another config or of other rows, naming it and what differs, and merging checks that the
parts cover the run's rows exactly once. Each part has a SHA-256 of its bytes beside it, written
after it: a part that cannot be read, or whose bytes do not match (or that has none: its write was
cut short), is damaged; a resume moves it to <out>.damaged/ and scores its chunk again, and a merge
refuses it. Merging deletes the parts it merged and nothing else; a merge killed after its file was
in place leaves parts that the next command on the run removes (the file's fingerprint is theirs).
An --overwrite deletes only what gradspec writes in the folder (parts, checksums, manifest, locks,
temporaries), and no run folder is followed through a symbolic link.

Where each idea lives, in the order data flows through a run:
  fingerprints   what a run records of itself: its config hashed, the model's identity on disk
  config_match   whether a recorded config is this run's, and what differs if not
  damage         whether a part found in the folder is this run's; a damaged one set aside
  parts          a chunk's rows as its part, and the partial part flushed while it is scored
  merge          the parts checked, then streamed into the output file
  folder         RunFolder: the life cycle (check, start, write, merge, abandon) over the above
The folder's locks, the numbered-parts layout and what guards the folder (no link followed, only
gradspec's own files deleted): gradspec.files.locks and gradspec.files.parts.
"""

from gradspec.files.locks import LOCK_STALE_S, RunLocked, Shard
from gradspec.runs.run_folder.fingerprints import (
    FINGERPRINT,
    MODEL_IDENTITY,
    NUMERICS,
    PART,
    config_fingerprint,
    model_identity,
)
from gradspec.runs.run_folder.folder import RunFolder
from gradspec.runs.run_folder.merge import INPUT_ERROR
from gradspec.runs.run_folder.parts import rows_table

__all__ = ["FINGERPRINT", "INPUT_ERROR", "LOCK_STALE_S", "MODEL_IDENTITY", "NUMERICS", "PART", "RunFolder", "RunLocked",
           "Shard", "config_fingerprint", "model_identity", "rows_table"]
