"""Everything gradspec does to the disk, once: reading only regular files, atomic writes of files and
folders and their temporaries, checksums, and the folders it writes and deletes in (files.locks: locks, no
link followed, only its own files deleted; files.parts: numbered parts and their compaction). Score runs,
the monitor, training, dynamics, validation and model conversion use these."""

from gradspec.files.primitives import (
    CHECKSUM,
    NotRegularFile,
    atomic_write,
    checksum_path,
    checksum_problem,
    create_new,
    is_temporary,
    load_failure,
    load_torch,
    open_regular,
    parquet_errors,
    place_folder,
    read_bytes,
    read_text,
    regular,
    sha256,
    temporary,
    temporary_of,
    write_checksum,
    write_checksummed,
    write_folder,
)

__all__ = ["CHECKSUM", "NotRegularFile", "atomic_write", "checksum_path", "checksum_problem", "create_new",
           "is_temporary", "load_failure", "load_torch", "open_regular", "parquet_errors", "place_folder", "read_bytes",
           "read_text", "regular", "sha256", "temporary", "temporary_of", "write_checksum", "write_checksummed",
           "write_folder"]
