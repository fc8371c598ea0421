"""Checkpoint shard files: the bytes of one table's rows from one rank, in the two
formats kvcoll has written. checkpoint.py decides what goes in them and when; this
module writes them, reads them back and verifies them.

Format 2 (bucketed pages). Every key has a bucket, (mix(key) >> 40) mod B, the same
hash bits that choose its owner rank ((mix(key) >> 40) mod world, kvcoll.routing), so
when the world size divides B every key of a bucket has one owner, on any world size.
B is per file, chosen by its writer (choose_buckets): the largest of BUCKET_LADDER
(11520 = 2^8 * 3^2 * 5, then halves down to 90, then 30, 6, 1; each divides the ones
before it) whose buckets would average at least BUCKET_BYTES over the whole table
(this file's size times the number of files), counting a removed key as a row (a
removal can keep a row alive during a restore, see checkpoint.py). So a page is large
enough for its per-page costs (a hash, a C call) not to matter, a large table gets
many buckets (at 11520 every world of 1-6, 8-10, 12, 15, 16, 18, 20, 24, 30, 32, ...
256 ranks divides B), and a small delta few. (With few buckets, a restore on a world
size B does not divide reads a bit more than its share, and keeps its own keys.)
A file is a run of pages, then an index, then a trailer:

    page 0 | page 1 | ... | index (.npy record) | trailer (32 bytes)

- A page holds one bucket's rows or its removed keys, at most PAGE_BYTES (a bucket
  with more takes several pages); pages are in bucket order, removed keys before rows,
  each starts on an 8-byte boundary (zero padding in between):
    rows page of n rows:  keys int64[n] | last_step uint32[n] | counts uint32[n] |
                          values float32[n, dim] | slots float32[n, slot_floats]
    removed page of m:    keys int64[m]
  Columns are contiguous, so a page read into memory goes to KvTable.import_ as it is.
- The index is a structured array (INDEX_DTYPE), one entry per page: its byte offset,
  its count, its bucket, its kind (REMOVED or ROWS) and the sha256 of its bytes
  (padding excluded).
- The trailer is MAGIC, the index's offset, dim and slot_floats: read_shard needs
  nothing else. The manifest holds the sha256 of the index and trailer together.

A rank restoring on M ranks reads the index of each file that can hold its keys, then
only the pages of its buckets, verifying each page's sha256 (PageReader).

Format 1 (version 1 checkpoints): six .npy records, one after the other: keys int64
[n], values float32 [n, dim], slots float32 [n, slot_floats], last_step uint32 [n],
counts uint32 [n], removed int64 [m]; the manifest holds the whole file's sha256. Kept
so that old checkpoints restore (and Checkpointer(version=1) writes it for a kvcoll
that only reads format 1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import io
import math
import os
import struct

import numpy as np

from .errors import CheckpointError
from .routing import owner_of

REMOVED, ROWS = 0, 1
PAGE_BYTES = 1 << 20
MAGIC = b"kvcoll-shard-2\n\0"
_TRAILER = struct.Struct("<16sQII")  # MAGIC, index offset, dim, slot_floats
TRAILER_BYTES = _TRAILER.size
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("count", "<u8"), ("bucket", "<u4"),
                        ("kind", "<u4"), ("sha256", "u1", (32,))])
MAX_BUCKETS = 1 << 16
BUCKET_LADDER = (11520, 5760, 2880, 1440, 720, 360, 180, 90, 30, 6, 1)
BUCKET_BYTES = 128 << 10
_WRITE_BUFFER = 8 << 20
_CHUNK = 16 << 20
V1_ARRAYS = ("keys", "values", "slots", "last_step", "counts", "removed")


def row_bytes(dim: int, slot_floats: int) -> int:
    """Bytes of one row in a rows page (the C table's row: a 16-byte header and floats)."""
    return 16 + 4 * (dim + slot_floats)


def choose_buckets(rows: int, removed: int, dim: int, slot_floats: int, files: int) -> int:
    """The bucket count of a file of `rows` rows and `removed` removed keys, one of
    `files` alike: the largest of BUCKET_LADDER whose buckets would average at least
    BUCKET_BYTES over them all, a removed key counted as a row (1 when tiny)."""
    total = (rows + removed) * row_bytes(dim, slot_floats) * files
    return next((b for b in BUCKET_LADDER if total >= b * BUCKET_BYTES), 1)


def page_length(kind, count, dim: int, slot_floats: int):
    """Bytes of a page's payload (no padding); works on arrays of kinds and counts."""
    return np.where(np.asarray(kind) == ROWS, row_bytes(dim, slot_floats), 8) * \
        np.asarray(count, np.uint64).astype(np.int64)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def buckets_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """The bucket of each key: (mix(key) >> 40) mod buckets (what owner_of computes
    for a world of `buckets` ranks)."""
    return owner_of(keys, buckets)


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while mv:  # raw writes may be short
        mv = mv[os.write(fd, mv):]


def split_page(view, kind: int, count: int, dim: int, slot_floats: int) -> dict:
    """A page's bytes (uint8 array) as zero-copy column arrays."""
    if kind == REMOVED:
        return {"removed": view[:8 * count].view(np.int64)}
    n = count
    a = 8 * n
    b = a + 4 * n
    c = b + 4 * n
    d = c + 4 * n * dim
    return {"keys": view[:a].view(np.int64), "last_step": view[a:b].view(np.uint32),
            "counts": view[b:c].view(np.uint32),
            "values": view[c:d].view(np.float32).reshape(n, dim),
            "slots": view[d:d + 4 * n * slot_floats].view(np.float32).reshape(n, slot_floats)}


# -- format 2: write ----------------------------------------------------------------------

def write_shard(path: str, rows: dict, removed: np.ndarray, buckets: int) -> dict:
    """Write rows (keys, values, slots, last_step, counts) and removed keys as a format-2
    shard file with `buckets` buckets, fsync it, and return what the manifest records:
    {"bytes", "rows", "removed", "buckets", "pages", "index": {"offset", "bytes",
    "sha256"}}."""
    keys = np.ascontiguousarray(rows["keys"], np.int64)
    values, slots = rows["values"], rows["slots"]
    last, counts = rows["last_step"], rows["counts"]
    removed = np.ascontiguousarray(removed, np.int64)
    n, dim, sf = keys.size, values.shape[1], slots.shape[1]
    per_page = max(1, PAGE_BYTES // row_bytes(dim, sf))
    per_removed = PAGE_BYTES // 8
    small = np.uint16 if buckets <= MAX_BUCKETS else np.int32  # a radix sort for uint16
    b_rows = buckets_of(keys, buckets).astype(small)
    order = np.argsort(b_rows, kind="stable")
    b_rem = buckets_of(removed, buckets).astype(small)
    removed = removed[np.argsort(b_rem, kind="stable")]
    n_rows = np.bincount(b_rows, minlength=buckets)
    n_rem = np.bincount(b_rem, minlength=buckets)
    del b_rows, b_rem
    start_rows = np.concatenate([[0], np.cumsum(n_rows)])
    start_rem = np.concatenate([[0], np.cumsum(n_rem)])

    entries = []
    buf = np.empty(max(_WRITE_BUFFER, _pad8(per_page * row_bytes(dim, sf))), np.uint8)
    fill = 0      # bytes of buf in use
    written = 0   # bytes of the file before buf
    with open(path, "xb", buffering=0) as f:
        fd = f.fileno()

        def room(nbytes: int) -> int:
            nonlocal fill, written
            if fill + nbytes > buf.size:
                _write_all(fd, buf[:fill])
                written += fill
                fill = 0
            return fill

        for b in np.flatnonzero(n_rows + n_rem).tolist():
            for s in range(int(start_rem[b]), int(start_rem[b + 1]), per_removed):
                e = min(s + per_removed, int(start_rem[b + 1]))
                length = 8 * (e - s)
                o = room(_pad8(length))
                buf[o:o + length].view(np.int64)[:] = removed[s:e]
                entries.append(_entry(written + o, e - s, b, REMOVED, buf[o:o + length]))
                buf[o + length:o + _pad8(length)] = 0
                fill = o + _pad8(length)
            for s in range(int(start_rows[b]), int(start_rows[b + 1]), per_page):
                e = min(s + per_page, int(start_rows[b + 1]))
                idx = order[s:e]
                length = (e - s) * row_bytes(dim, sf)
                o = room(_pad8(length))
                cols = split_page(buf[o:o + length], ROWS, e - s, dim, sf)
                np.take(keys, idx, out=cols["keys"], mode="clip")
                np.take(last, idx, out=cols["last_step"], mode="clip")
                np.take(counts, idx, out=cols["counts"], mode="clip")
                np.take(values, idx, axis=0, out=cols["values"], mode="clip")
                if sf:
                    np.take(slots, idx, axis=0, out=cols["slots"], mode="clip")
                entries.append(_entry(written + o, e - s, b, ROWS, buf[o:o + length]))
                buf[o + length:o + _pad8(length)] = 0
                fill = o + _pad8(length)
        _write_all(fd, buf[:fill])
        index_offset = written + fill
        index = np.array(entries, INDEX_DTYPE)
        head = io.BytesIO()
        np.lib.format.write_array(head, index, allow_pickle=False)
        tail = head.getvalue() + _TRAILER.pack(MAGIC, index_offset, dim, sf)
        _write_all(fd, tail)
        os.fsync(fd)
    return {"bytes": index_offset + len(tail), "rows": int(n), "removed": int(removed.size),
            "buckets": int(buckets), "pages": int(index.size),
            "index": {"offset": int(index_offset), "bytes": len(tail),
                      "sha256": hashlib.sha256(tail).hexdigest()}}


def _npy_header(fp, path: str, what: str) -> tuple:
    """(shape, fortran order, dtype) of the .npy header at fp's position."""
    try:
        major, _ = np.lib.format.read_magic(fp)
        read = np.lib.format.read_array_header_1_0 if major == 1 \
            else np.lib.format.read_array_header_2_0
        return read(fp)
    # numpy parses the header's dict with Python's tokenizer and literal_eval, which
    # raise more than ValueError on garbage (TokenError, SyntaxError, MemoryError, ...)
    except Exception as exc:  # noqa: BLE001 - any failure means: not a .npy record
        raise CheckpointError(f"checkpoint file {path}: {what} is not a .npy record "
                              f"({type(exc).__name__}: {exc}); the file is corrupt, "
                              "restore an earlier checkpoint") from None


def _entry(offset: int, count: int, bucket: int, kind: int, data) -> tuple:
    return (offset, count, bucket, kind, np.frombuffer(hashlib.sha256(data).digest(), np.uint8))


# -- format 2: read ----------------------------------------------------------------------

def check_size(path: str, size: int) -> None:
    """CheckpointError unless the file exists with `size` bytes."""
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if actual != size:
        raise CheckpointError(f"checkpoint file {path} has {actual} bytes, the manifest "
                              f"says {size}: it is truncated or was replaced")


def read_index(path: str, info: dict, dim: int, slot_floats: int, buckets: int) -> np.ndarray:
    """The verified page index of a format-2 file whose manifest entry is `info`:
    size, the index's sha256, the trailer, and every entry's bounds, kind, bucket and
    counts against the manifest. Raises CheckpointError."""
    check_size(path, info["bytes"])
    ix = info["index"]
    offset, nbytes = int(ix["offset"]), int(ix["bytes"])
    if offset < 0 or nbytes < TRAILER_BYTES or offset + nbytes != info["bytes"]:
        raise CheckpointError(f"checkpoint file {path}: the manifest's index range "
                              f"({offset}, {nbytes} bytes) does not end the file")
    with open(path, "rb") as f:
        f.seek(offset)
        tail = f.read(nbytes)
    if len(tail) != nbytes:
        raise CheckpointError(f"checkpoint file {path} ended early")
    if hashlib.sha256(tail).hexdigest() != ix["sha256"]:
        raise CheckpointError(f"checkpoint file {path}: its index fails its sha256 check "
                              "(corrupt); restore an earlier checkpoint")
    return _parse_index(path, tail, offset, dim, slot_floats, buckets, info)


def _parse_index(path, tail: bytes, offset: int, dim, slot_floats, buckets, info=None):
    magic, at, t_dim, t_sf = _TRAILER.unpack(tail[-TRAILER_BYTES:])
    if magic != MAGIC or at != offset or (dim is not None and (t_dim, t_sf) != (dim, slot_floats)):
        raise CheckpointError(f"checkpoint file {path}: its trailer says index at {at}, dim "
                              f"{t_dim}, {t_sf} slot floats; expected {offset}, {dim}, "
                              f"{slot_floats} (not a matching kvcoll shard file)")
    dim, slot_floats = t_dim, t_sf
    fp = io.BytesIO(tail[:-TRAILER_BYTES])
    shape, fortran, dtype = _npy_header(fp, path, "the index")
    if dtype != INDEX_DTYPE or fortran or len(shape) != 1 or \
            fp.tell() + shape[0] * INDEX_DTYPE.itemsize != len(tail) - TRAILER_BYTES:
        raise CheckpointError(f"checkpoint file {path}: the index has dtype {dtype} and "
                              f"shape {shape}, expected {INDEX_DTYPE} [pages]")
    index = np.frombuffer(tail, INDEX_DTYPE, shape[0], fp.tell())
    # offset and count are untrusted uint64: bound them before any arithmetic can wrap
    unit = np.where(index["kind"] == ROWS, row_bytes(dim, slot_floats), 8).astype(np.uint64)
    bad = (index["kind"] > ROWS) | (index["count"] == 0) | (index["bucket"] >= buckets) | \
        (index["offset"] % 8 != 0) | (index["offset"] > np.uint64(offset)) | \
        (index["count"] > (np.uint64(offset) - np.minimum(index["offset"], offset)) // unit)
    length = page_length(index["kind"], np.where(bad, 0, index["count"]), dim, slot_floats)
    ends = np.where(bad, 0, index["offset"]).astype(np.int64) + length
    if index.size > 1:
        bad[1:] |= index["offset"][1:].astype(np.int64) < ends[:-1]
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CheckpointError(f"checkpoint file {path}: index entry {i} ({index[i]}) is "
                              f"not a valid page of {buckets} buckets (corrupt)")
    if info is not None:
        got = {k: int(index["count"][index["kind"] == kind].sum())
               for k, kind in (("rows", ROWS), ("removed", REMOVED))}
        want = {k: info[k] for k in got}
        if got != want:
            raise CheckpointError(f"checkpoint file {path}: its pages hold {got}, the "
                                  f"manifest says {want} (corrupt)")
    return index


class PageReader:
    """Reads pages of shard files into reused buffers of at most `limit` bytes each (a
    single page larger than that gets a buffer of its own size) and verifies each
    page's sha256, hashing on `threads` threads (hashlib lets go of the GIL). batches()
    reads the next batch in the background while the caller uses the current one (two
    buffers). Keeps up to 64 files open."""

    def __init__(self, limit: int, threads: int = 2):
        self.limit = int(limit)
        self.bytes_read = 0
        self._bufs = [None, None]
        self._fds: collections.OrderedDict = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None

    def _fd(self, path: str) -> int:
        fd = self._fds.pop(path, None)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file {path} is missing") from None
            if len(self._fds) >= 64:
                os.close(self._fds.popitem(last=False)[1])
        self._fds[path] = fd
        return fd

    def _buffer(self, slot: int, total: int) -> np.ndarray:
        buf = self._bufs[slot]
        if buf is None or buf.size < total:
            self._bufs[slot] = None
            buf = self._bufs[slot] = np.empty(max(total, self.limit), np.uint8)
        return buf

    def read(self, paths: list, pages: np.ndarray, *, keep: bool = False,
             slot: int = 0) -> list:
        """The bytes of `pages` (structured, with fields file (index into paths),
        offset, length, sha256) as uint8 arrays, in the order given, verified.
        keep=True reads into a new buffer that the caller may keep; otherwise into
        buffer `slot` (0 or 1), and the views are valid until its next read."""
        total = int(_padded(pages["length"]).sum())
        if total > self.limit and pages.size > 1:
            raise ValueError(f"{total} bytes of pages exceed the read buffer of "
                             f"{self.limit} bytes")
        buf = np.empty(total, np.uint8) if keep else self._buffer(slot, total)
        # read in file order, adjacent pages of a file in one call
        order = np.lexsort((pages["offset"], pages["file"]))
        at = np.empty(pages.size, np.int64)  # each page's position in buf
        runs = []  # [file, offset, end, position in buf]
        pos = 0
        for i in order.tolist():
            file, offset = int(pages["file"][i]), int(pages["offset"][i])
            span = _pad8(int(pages["length"][i]))
            if runs and runs[-1][0] == file and runs[-1][2] == offset:
                runs[-1][2] += span
            else:
                runs.append([file, offset, offset + span, pos])
            at[i] = pos
            pos += span
        for file, offset, end, start in runs:
            self._pread(paths[file], buf, start, offset, end - offset)
        views = [buf[at[i]:at[i] + int(pages["length"][i])] for i in range(pages.size)]
        digests = list(self._pool.map(_sha256, views)) if self._pool and len(views) > 1 \
            else [_sha256(v) for v in views]
        for i, digest in enumerate(digests):
            if digest != pages["sha256"][i].tobytes():
                raise CheckpointError(
                    f"checkpoint file {paths[int(pages['file'][i])]}: the page at byte "
                    f"{int(pages['offset'][i])} fails its sha256 check (corrupt); "
                    "restore an earlier checkpoint")
        return views

    def batches(self, paths: list, pages: np.ndarray, batches):
        """Yield (batch, its pages' verified bytes) for each batch (an array of page
        numbers), reading and verifying the next batch on a thread of its own while the
        caller uses this one. An error of a read is raised here, in order."""
        with concurrent.futures.ThreadPoolExecutor(1) as ahead:
            it = iter(batches)
            nxt, slot = next(it, None), 0
            job = None if nxt is None else ahead.submit(self.read, paths, pages[nxt], slot=0)
            while nxt is not None:
                cur, views = nxt, job.result()
                nxt, slot = next(it, None), slot ^ 1
                if nxt is not None:
                    job = ahead.submit(self.read, paths, pages[nxt], slot=slot)
                yield cur, views

    def _pread(self, path: str, buf: np.ndarray, at: int, offset: int, nbytes: int) -> None:
        fd = self._fd(path)
        mv = memoryview(buf)[at:at + nbytes]
        while mv:
            n = os.preadv(fd, [mv], offset)
            if n <= 0:
                raise CheckpointError(f"checkpoint file {path} ended early")
            mv, offset = mv[n:], offset + n
            self.bytes_read += n

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])
        self._bufs = [None, None]
        if self._pool is not None:
            self._pool.shutdown()


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def _padded(lengths) -> np.ndarray:
    return (np.asarray(lengths, np.int64) + 7) & ~7


# -- format 1 (version 1 checkpoints) ------------------------------------------------------

def write_shard_v1(path: str, arrays: list) -> tuple[str, int]:
    """Write arrays as consecutive .npy records, fsync, return (sha256, bytes)."""
    h = hashlib.sha256()
    total = 0
    with open(path, "xb", buffering=0) as f:
        for arr in arrays:
            arr = np.ascontiguousarray(arr)
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                head, np.lib.format.header_data_from_array_1_0(arr))
            part_list = (memoryview(head.getbuffer()),
                         memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")
            for part in part_list:
                for at in range(0, len(part), _CHUNK):
                    chunk = part[at:at + _CHUNK]
                    h.update(chunk)
                    _write_all(f.fileno(), chunk)
                total += len(part)
        os.fsync(f.fileno())
    return h.hexdigest(), total


def read_verified(path: str, sha256: str, size: int) -> np.ndarray:
    """The whole file as uint8, after checking its size and sha256."""
    check_size(path, size)
    buf = np.empty(size, np.uint8)
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(buf)
        at = 0
        while at < size:
            n = f.readinto(mv[at:at + _CHUNK])
            if not n:
                raise CheckpointError(f"checkpoint file {path} ended early")
            h.update(mv[at:at + n])
            at += n
    if h.hexdigest() != sha256:
        raise CheckpointError(f"checkpoint file {path} fails its sha256 check (corrupt); "
                              "restore an earlier checkpoint")
    return buf


def sha256_file(path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def parse_records_v1(buf: np.ndarray, path: str) -> list[np.ndarray]:
    """The .npy records of a format-1 file's bytes, as views into buf."""
    out = []
    at = 0
    raw = memoryview(buf)
    while at < buf.size:
        fp = io.BytesIO(raw[at:at + 65536 + 16].tobytes())
        shape, fortran, dtype = _npy_header(fp, path, f"record {len(out)}")
        start = at + fp.tell()
        count = math.prod(shape)  # Python ints: a huge shape cannot wrap
        end = start + count * dtype.itemsize
        plain = dtype.kind in "biuf" and dtype.fields is None and dtype.subdtype is None
        if fortran or end > buf.size or not plain or min(shape, default=0) < 0:
            raise CheckpointError(f"checkpoint file {path}: record {len(out)} is malformed "
                                  f"({dtype} {shape}, {buf.size - start} bytes left); the "
                                  "file is corrupt, restore an earlier checkpoint")
        out.append(buf[start:end].view(dtype).reshape(shape))
        at = end
    return out


def check_records_v1(records: list, path: str, dim, slot_floats) -> dict:
    """A format-1 file's records by name, with their dtypes and shapes checked."""
    if len(records) != len(V1_ARRAYS):
        raise CheckpointError(f"checkpoint file {path}: {len(records)} arrays, expected "
                              f"{len(V1_ARRAYS)} ({', '.join(V1_ARRAYS)})")
    a = dict(zip(V1_ARRAYS, records))
    n = a["keys"].shape[0] if a["keys"].ndim == 1 else -1
    dim = a["values"].shape[1] if dim is None and a["values"].ndim == 2 else dim
    slot_floats = a["slots"].shape[1] if slot_floats is None and a["slots"].ndim == 2 \
        else slot_floats
    want = {"keys": ((n,), np.int64), "values": ((n, dim), np.float32),
            "slots": ((n, slot_floats), np.float32), "last_step": ((n,), np.uint32),
            "counts": ((n,), np.uint32)}
    for name, (shape, dtype) in want.items():
        if a[name].shape != shape or a[name].dtype != dtype:
            raise CheckpointError(
                f"checkpoint file {path}: {name} is {a[name].dtype} {a[name].shape}, "
                f"expected {np.dtype(dtype)} {shape}")
    if a["removed"].ndim != 1 or a["removed"].dtype != np.int64:
        raise CheckpointError(f"checkpoint file {path}: removed must be int64 [m]")
    check_finite(a["values"], a["slots"], path, "its rows")
    return a


def check_finite(values: np.ndarray, slots: np.ndarray, path: str, where: str) -> None:
    """CheckpointError if a value or slot is NaN or Inf: a table never holds one, so
    the file is corrupt (and importing it would fail half-way through a restore)."""
    for name, a in (("values", values), ("slots", slots)):
        if a.size and not np.isfinite(a).all():
            raise CheckpointError(f"checkpoint file {path}: {where} hold non-finite {name} "
                                  "(NaN or Inf; kvcoll never writes them): the file is "
                                  "corrupt, restore an earlier checkpoint")


# -- either format, without a manifest --------------------------------------------------------

def read_shard(path: str) -> dict:
    """A shard file's arrays by name (keys, values, slots, last_step, counts, removed),
    in file order, from either format. Format 2 pages are checked against their own
    index's sha256; the index itself (and a format-1 file) is verified only by a
    restore, against the manifest."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < TRAILER_BYTES or data[-TRAILER_BYTES:][:len(MAGIC)] != MAGIC:
        buf = np.frombuffer(data, np.uint8)
        return check_records_v1(parse_records_v1(buf, path), path, None, None)
    _, offset, dim, sf = _TRAILER.unpack(data[-TRAILER_BYTES:])
    if offset > len(data) - TRAILER_BYTES:
        raise CheckpointError(f"checkpoint file {path}: its trailer puts the index at byte "
                              f"{offset}, past the end of its {len(data)} bytes (corrupt)")
    index = _parse_index(path, data[offset:], offset, None, None, MAX_BUCKETS)
    buf = np.frombuffer(data, np.uint8)
    parts = {k: [] for k in V1_ARRAYS}
    for e in index:
        view = buf[int(e["offset"]):int(e["offset"]) + int(page_length(e["kind"], e["count"],
                                                                       dim, sf))]
        if hashlib.sha256(view).digest() != e["sha256"].tobytes():
            raise CheckpointError(f"checkpoint file {path}: the page at byte "
                                  f"{int(e['offset'])} fails its sha256 check (corrupt)")
        for k, v in split_page(view, int(e["kind"]), int(e["count"]), dim, sf).items():
            parts[k].append(v)
    empty = {"keys": np.zeros(0, np.int64), "values": np.zeros((0, dim), np.float32),
             "slots": np.zeros((0, sf), np.float32), "last_step": np.zeros(0, np.uint32),
             "counts": np.zeros(0, np.uint32), "removed": np.zeros(0, np.int64)}
    return {k: np.concatenate(v) if v else empty[k] for k, v in parts.items()}
