"""A FAISS index beside a projected store, so that `align --store --top K` reads a few thousand rows of
a million instead of all of them.

Two files beside the store S (`gradspec project --index`):
- ``S.faiss``: a header (what it indexes: the store's identity, the settings, the recall measured when
  it was built, a SHA-256 per block of S.vectors) and a FAISS index over each row's whole-model
  projected vector, L2-normalised, so that an inner product is the cosine the exact scan ranks by.
  Written atomically with its SHA-256 beside it (S.faiss.sha256).
- ``S.vectors``: the store's projected vectors as they are in the store (float32, row-major, NaN rows
  where the store has none), for reading the candidates' rows directly: a Parquet row group is 64 MB.

Both are data. S.faiss is read once, whole, its SHA-256 checked on those very bytes before FAISS
parses them (FAISS's reader trusts its input); a file of another store (its size, rows or footer
differ), a symbolic link, a damaged or truncated file is refused naming it. S.vectors is checked a
block at a time, each block read against its SHA-256 in the verified header.

The index: up to FLAT_ROWS rows, exact (IndexFlatIP); beyond, the vectors are reduced to REDUCED
dimensions by the top right singular vectors of a sample (uncentred: inner products are kept, not
covariances) and indexed by IVF with 8-bit scalar quantisation, nlist about 2 sqrt(N). Its answers are
candidates only: every returned row's values are computed again, exactly, from S.vectors.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from gradspec.errors import InputError
from gradspec.files import atomic_write, checksum_path, checksum_problem, open_regular, regular, write_checksummed
from gradspec.runs.score_files import PROJECTION, read_metadata

MAGIC = b"GRADSPEC-FAISS-1\n"
INDEX_SUFFIX, VECTORS_SUFFIX = ".faiss", ".vectors"
FLAT_ROWS = 20_000  # up to this many rows, the exact flat index
REDUCED = 256  # dimensions an IVF index sees (the re-rank sees them all)
BLOCK_BYTES = 1 << 16  # S.vectors is checked in blocks of about this size
CANDIDATES = 10  # per row asked for, re-ranked exactly
PROBES, PROBE_ROWS, RECALL_AT = 8, 16, 100  # recall at build: 8 queries, each the mean of 16 random rows
TARGET_RECALL = 0.99  # nprobe is the smallest power of 2 whose measured recall reaches it
READ_BYTES = 64 << 20  # rows read at a time: at most 4096, and about this many bytes
SVD_ROWS, SVD_BYTES = 20_000, 256 << 20  # the reduction is fitted on a sample of at most these rows and bytes


def index_path(store: str | Path) -> Path:
    return Path(f"{store}{INDEX_SUFFIX}")


def vectors_path(store: str | Path) -> Path:
    return Path(f"{store}{VECTORS_SUFFIX}")


def require_faiss():
    """The faiss module, or an InputError saying how to install it (an optional extra)."""
    try:
        import faiss
    except ImportError:
        raise InputError("an index of a store needs FAISS: pip install 'gradspec[faiss]' (faiss-cpu)") from None
    return faiss


def store_identity(store: str | Path) -> dict[str, Any]:
    """What tells this store from another without reading it all: its size, rows, width and the SHA-256
    of its Parquet footer (every row group's offsets and statistics)."""
    with open_regular(store, "a store from gradspec project") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 12:
            raise InputError(f"{store}: not a Parquet file (only {size} bytes)")
        f.seek(size - 8)
        length, magic = struct.unpack("<I4s", f.read(8))
        if magic != b"PAR1" or length > size - 12:
            raise InputError(f"{store}: not a Parquet file (no footer)")
        f.seek(size - 8 - length)
        footer = hashlib.sha256(f.read(length)).hexdigest()
    meta = pq.read_metadata(regular(store))
    return {"size": size, "rows": meta.num_rows, "footer_sha256": footer}


def _store_dims(store: str | Path) -> tuple[dict[str, Any], int]:
    meta = read_metadata(store)
    projection = meta.get("projection")
    if not projection:
        raise InputError(f"{store} holds no projected gradients; write a store with `gradspec project`")
    return meta, len(projection["parts"]) * projection["k_in"] * projection["k_out"]


def _step(dims: int) -> int:
    return max(1, min(4096, READ_BYTES // (4 * dims)))


def _normalised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows scaled to unit norm, which rows are usable: finite, nonzero)."""
    with np.errstate(invalid="ignore", over="ignore"):
        norms = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
    usable = np.isfinite(norms) & (norms > 0)
    out = np.zeros_like(x, dtype=np.float32)
    out[usable] = x[usable] / norms[usable, None]
    return out, usable


def _top(scores: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """ids of the k highest scores, highest first."""
    k = min(k, len(scores))
    pick = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    return ids[pick[np.argsort(-scores[pick], kind="stable")]]


def build_index(store: str | Path, seed: int = 0) -> dict[str, Any]:
    """Writes S.vectors then S.faiss beside the store (replacing any); returns the header written. The
    recall it records: for PROBES queries (each the mean of PROBE_ROWS random rows' vectors, as a task's
    mean gradient is a mean), the share of the exact top RECALL_AT (over every row, by cosine) that the
    index's candidates re-ranked exactly find, at each nprobe tried."""
    require_faiss()  # before the store is read
    started = time.perf_counter()
    store = Path(store)
    _, dims = _store_dims(store)
    identity = store_identity(store)
    block_rows = max(1, BLOCK_BYTES // (4 * dims))
    step = _step(dims)
    hashes: list[str] = []
    usable_parts: list[np.ndarray] = []  # each batch's rows with a finite nonzero vector
    batch_start = [0]

    def write_vectors(f) -> None:  # the store's vectors as they are; a hash per block_rows rows
        pending = np.empty((0, dims), np.float32)
        with pq.ParquetFile(regular(store), pre_buffer=False, buffer_size=1 << 20) as reader:  # see query_store
            for batch in reader.iter_batches(batch_size=step, columns=[PROJECTION]):
                values = batch.column(0)
                block = np.full((len(batch), dims), np.nan, np.float32)
                present = ~np.asarray(values.is_null().to_numpy(zero_copy_only=False), dtype=bool)
                if present.any():
                    flat = values.drop_null().flatten().to_numpy(zero_copy_only=False)
                    if len(flat) != present.sum() * dims:
                        raise InputError(f"{store}: its {PROJECTION} rows do not all hold the {dims} values its "
                                         f"projection (parts, k) makes")
                    block[present] = np.asarray(flat, np.float32).reshape(-1, dims)
                usable_parts.append(np.flatnonzero(_normalised(block)[1]) + batch_start[0])
                batch_start[0] += len(block)
                pending = np.concatenate([pending, block])
                whole = len(pending) // block_rows * block_rows
                for k in range(0, whole, block_rows):
                    data = pending[k:k + block_rows].tobytes()
                    hashes.append(hashlib.sha256(data).hexdigest())
                    f.write(data)
                pending = pending[whole:]
        if len(pending):
            hashes.append(hashlib.sha256(pending.tobytes()).hexdigest())
            f.write(pending.tobytes())

    atomic_write(vectors_path(store), write_vectors)
    with open_regular(vectors_path(store)) as f:
        return _build(f, store, identity, dims, block_rows, hashes, usable_parts, seed, started)


def _build(file, store: Path, identity: dict[str, Any], dims: int, block_rows: int, hashes: list[str],
           usable_parts: list[np.ndarray], seed: int, started: float) -> dict[str, Any]:
    faiss = require_faiss()
    rows, step = identity["rows"], _step(dims)
    vectors = _Rows(file, rows, dims)
    usable_rows = np.concatenate(usable_parts) if usable_parts else np.zeros(0, np.int64)
    if not len(usable_rows):
        raise InputError(f"{store}: no row has a usable projected gradient to index")
    rng = np.random.default_rng(seed)
    probes = np.stack([_normalised(vectors[np.sort(rng.choice(usable_rows, min(PROBE_ROWS, len(usable_rows)),
                                                               replace=False))].mean(0, keepdims=True))[0][0]
                       for _ in range(PROBES)])
    settings: dict[str, Any] = {"kind": "flat", "dims": dims}
    if len(usable_rows) <= FLAT_ROWS:
        index = faiss.IndexIDMap(faiss.IndexFlatIP(dims))
        nlist = None
    else:
        nlist = 2 ** round(math.log2(2 * math.sqrt(len(usable_rows))))
        train = np.sort(rng.choice(usable_rows, min(len(usable_rows), 40 * nlist), replace=False))
        reduced = min(dims, REDUCED)
        fit = np.sort(rng.choice(train, min(len(train), SVD_ROWS, SVD_BYTES // (4 * dims)), replace=False))
        basis = _basis(_normalised(vectors[fit])[0], reduced, seed)
        transform = faiss.LinearTransform(dims, reduced, False)
        faiss.copy_array_to_vector(basis.ravel(), transform.A)
        transform.is_trained = True
        quantizer = faiss.IndexFlatIP(reduced)
        ivf = faiss.IndexIVFScalarQuantizer(quantizer, reduced, nlist, faiss.ScalarQuantizer.QT_8bit,
                                            faiss.METRIC_INNER_PRODUCT)
        ivf.train(np.concatenate([_normalised(vectors[train[i:i + step]])[0] @ basis.T
                                  for i in range(0, len(train), step)]))  # reduced a batch at a time
        index = faiss.IndexPreTransform(transform, ivf)
        settings = {"kind": f"IVF{nlist},SQ8", "dims": dims, "reduced": reduced, "nlist": nlist}
    exact = [(np.zeros(0, np.float32), np.zeros(0, np.int64)) for _ in range(PROBES)]
    for i in range(0, rows, step):
        unit, usable = _normalised(vectors[i:i + step])
        ids = np.flatnonzero(usable) + i
        index.add_with_ids(unit[usable], ids.astype(np.int64))
        scores = probes @ unit[usable].T
        for p in range(PROBES):  # the running exact top of each probe
            s, j = np.concatenate([exact[p][0], scores[p]]), np.concatenate([exact[p][1], ids])
            keep = np.argsort(-s, kind="stable")[:RECALL_AT]
            exact[p] = (s[keep], j[keep])
    built_s = time.perf_counter() - started
    recall: dict[str, float] = {}
    nprobe = None
    if nlist is not None:
        for n in [2 ** e for e in range(int(math.log2(nlist)) + 1)]:
            recall[str(n)] = _probe_recall(index, n, probes, exact, vectors)
            if recall[str(n)] >= TARGET_RECALL or n == nlist:
                nprobe = n
                break
    else:
        recall["flat"] = _probe_recall(index, None, probes, exact, vectors)
    header = {"format": 1, "store": {**identity, "name": store.name}, "dims": dims, "indexed": int(len(usable_rows)),
              "settings": {**settings, "nprobe": nprobe, "candidates": CANDIDATES},
              "recall": {"at": RECALL_AT, "probes": PROBES, "probe_rows": PROBE_ROWS, "by_nprobe": recall,
                         "value": recall[str(nprobe) if nprobe is not None else "flat"], "seed": seed},
              "vectors": {"file": vectors_path(store).name, "block_rows": block_rows, "sha256": hashes},
              "build_s": round(built_s, 3)}
    body = faiss.serialize_index(index).tobytes()
    head = json.dumps(header).encode()

    def write_index(f) -> None:
        f.write(MAGIC)
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.write(body)

    write_checksummed(index_path(store), write_index)
    return header


def _basis(sample: np.ndarray, reduced: int, seed: int) -> np.ndarray:
    """(reduced, dims): the top right singular vectors of the sample (uncentred), orthonormal rows."""
    import torch

    if reduced >= sample.shape[1]:
        return np.eye(sample.shape[1], dtype=np.float32)
    torch.manual_seed(seed)
    _, _, v = torch.svd_lowrank(torch.from_numpy(sample), q=reduced, niter=3)
    return np.ascontiguousarray(v.T.numpy(), dtype=np.float32)


def _probe_recall(index, nprobe: int | None, probes: np.ndarray, exact: list, vectors: np.ndarray) -> float:
    found = []
    for p, q in enumerate(probes):
        ids = _candidates(index, nprobe, q[None, :], RECALL_AT * CANDIDATES)
        unit, usable = _normalised(vectors[np.sort(ids)])
        got = _top(unit @ q, np.sort(ids), RECALL_AT)
        found.append(len(set(got.tolist()) & set(exact[p][1].tolist())) / len(exact[p][1]))
    return round(float(np.mean(found)), 4)


def _candidates(index, nprobe: int | None, queries: np.ndarray, k: int) -> np.ndarray:
    """The distinct row ids the index returns for any of the queries (unit rows), k each."""
    faiss = require_faiss()
    params = faiss.SearchParametersIVF(nprobe=nprobe) if nprobe is not None else None
    if params is not None:
        params = faiss.SearchParametersPreTransform(index_params=params)
    _, ids = index.search(np.ascontiguousarray(queries, np.float32), min(k, index.ntotal), params=params)
    return np.unique(ids[ids >= 0])


class _Rows:
    """Rows of S.vectors read with pread (a slice in one read, an array of row numbers one row each): a map of
    the file would count every page it touched in the process's RSS."""

    def __init__(self, file, rows: int, dims: int):
        self.fd, self.rows, self.dims = file.fileno(), rows, dims

    def __getitem__(self, key) -> np.ndarray:
        width = 4 * self.dims
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.rows)
            data = os.pread(self.fd, (stop - start) * width, start * width)
            return np.frombuffer(data, np.float32).reshape(-1, self.dims).copy()
        out = np.empty((len(key), self.dims), np.float32)
        for k, row in enumerate(np.asarray(key).tolist()):
            out[k] = np.frombuffer(os.pread(self.fd, width, row * width), np.float32)
        return out


@dataclass
class StoreIndex:
    """A verified index of a store: the FAISS index, its header, and the store's vectors mapped."""

    store: Path
    header: dict[str, Any]
    index: Any
    vectors: _Rows
    file: Any = None  # S.vectors, open

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def describe(self) -> str:
        s = self.header["settings"]
        r = self.header["recall"]
        how = "exact (flat)" if s["kind"] == "flat" else \
            f"{s['kind']} over {s['reduced']} of {s['dims']} dimensions, nprobe {s['nprobe']}"
        return (f"{how}, {s['candidates']} candidates per row asked, re-ranked exactly; recall@{r['at']} "
                f"{r['value']:.3f} measured at build ({r['probes']} probe queries, each the mean of {r['probe_rows']} "
                f"random rows)")

    def candidates(self, queries: np.ndarray, top: int) -> np.ndarray:
        """Row numbers to re-rank: the union of the index's top (CANDIDATES x top) for each query."""
        unit, usable = _normalised(np.asarray(queries, np.float32))
        return _candidates(self.index, self.header["settings"]["nprobe"], unit[usable],
                           top * self.header["settings"]["candidates"])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The store's vectors of these rows (sorted ids), each block read checked against its SHA-256."""
        block_rows, hashes = self.header["vectors"]["block_rows"], self.header["vectors"]["sha256"]
        out = np.empty((len(ids), self.header["dims"]), np.float32)
        blocks = ids // block_rows
        for b in np.unique(blocks):
            data = self.vectors[b * block_rows:(b + 1) * block_rows]
            if hashlib.sha256(data.tobytes()).hexdigest() != hashes[b]:
                raise InputError(f"{vectors_path(self.store)}: damaged, block {b} (rows {b * block_rows}-"
                                 f"{b * block_rows + len(data) - 1}) differs from what was written; build the "
                                 f"index again ({_rebuild(self.store)})")
            pick = blocks == b
            out[pick] = data[ids[pick] - b * block_rows]
        return out


def _rebuild(store: Path) -> str:
    return f"gradspec project --out {store} --resume --index, with the options that wrote it"


def _no_link(path: Path, what: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise InputError(f"{path}: no {what} beside the store; build one ({_rebuild(path.parent)})") from None
    if stat.S_ISLNK(mode):
        raise InputError(f"{path}: a symbolic link, refused (an index is read only as a file gradspec wrote there)")


def read_index(store: str | Path) -> StoreIndex:
    """The store's index, verified (see the module's docstring), or InputError naming the file and why."""
    faiss = require_faiss()
    store = Path(store)
    path, vpath = index_path(store), vectors_path(store)
    _no_link(path, "index")
    _no_link(checksum_path(path), "index checksum")
    with open_regular(path, "an index from gradspec project --index") as f:
        data = f.read()
    problem = checksum_problem(path, data)
    if problem is not None:
        raise InputError(f"{path}: {problem}; build it again ({_rebuild(store)})")
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not an index gradspec wrote")
        (length,) = struct.unpack_from("<Q", data, len(MAGIC))
        start = len(MAGIC) + 8
        header = json.loads(data[start:start + length])
        if header.get("format") != 1:
            raise ValueError(f"format {header.get('format')!r}, not 1")
        body = memoryview(data)[start + length:]  # not a copy: an index of a million rows is hundreds of MB
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a readable index ({e})") from None
    identity = store_identity(store)
    recorded = {k: header["store"].get(k) for k in identity}
    if recorded != identity:
        differ = ", ".join(f"{k} {recorded[k]} (now {identity[k]})" for k in identity if recorded[k] != identity[k])
        raise InputError(f"{path}: an index of another store than {store} ({differ}); build it again "
                         f"({_rebuild(store)})")
    _, dims = _store_dims(store)
    try:
        index = faiss.deserialize_index(np.frombuffer(body, np.uint8))
    except Exception as e:  # FAISS raises RuntimeError with its C++ message
        raise InputError(f"{path}: not a readable FAISS index ({str(e).splitlines()[0][:200]})") from None
    if index.d != dims or index.ntotal != header["indexed"] or header["dims"] != dims:
        raise InputError(f"{path}: its index has {index.ntotal} rows of {index.d} dimensions, the store's rows have "
                         f"{dims} and it recorded {header['indexed']}")
    _no_link(vpath, "vectors file")
    file = open_regular(vpath, "the vectors gradspec project --index wrote")  # held open: what is checked is read
    size = os.fstat(file.fileno()).st_size
    if size != identity["rows"] * dims * 4:
        file.close()
        raise InputError(f"{vpath}: damaged, {size} bytes where {identity['rows']} rows of {dims} float32 take "
                         f"{identity['rows'] * dims * 4}; build the index again ({_rebuild(store)})")
    return StoreIndex(store, header, index, _Rows(file, identity["rows"], dims), file)
