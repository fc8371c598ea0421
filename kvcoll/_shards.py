"""Checkpoint shard files: the bytes of one table's rows from one rank, in the three
formats kvcoll has written. checkpoint.py decides what goes in them and when; this
module writes them, reads them back and verifies them.

Format 3 (pages by model bucket). Every key has a bucket among the model's B buckets
(kvcoll.routing: (mix(key) >> 40) mod B, B = routing.BUCKETS = 65,536 unless the run
chose another, fixed for the life of a model and recorded in every manifest); the
bucket -> rank map (routing.OwnerMap) decides which rank owns it. A file holds the keys
of the buckets its writer owned, sorted by bucket, in pages of at most PAGE_BYTES: a
page holds consecutive rows of that order, so it covers a run of buckets [first,
last] (a big bucket spans several pages, a small delta is one page whatever B is).
A reader that owns some buckets reads only the pages whose runs meet them, and keeps
only its keys from a page that also holds others'. A file is a run of pages, then an
index, then a trailer:

    page 0 | page 1 | ... | index (.npy record) | trailer (40 bytes)

- The removed-keys pages come first, then the rows pages, each in bucket order; each
  page starts on an 8-byte boundary (zero padding in between):
    rows page of n rows:  keys int64[n] | last_step uint32[n] | counts uint32[n] |
                          values float32[n, dim] | slots float32[n, slot_floats]
    removed page of m:    keys int64[m]
  Columns are contiguous, so a page read into memory goes to KvTable.import_ as it is.
- The index is a structured array (INDEX_DTYPE), one entry per page, in file order:
  its byte offset, its count, the first and last bucket of its keys, its kind (REMOVED
  or ROWS) and the sha256 of its bytes (padding excluded).
- The trailer is MAGIC, the index's offset, dim, slot_floats and B (then 4 zero
  bytes): read_shard needs nothing else. The manifest holds the sha256 of the index
  and trailer together.

Format 2 (version 2 checkpoints, read only). Every page held one bucket of B2 per file
(a file's own count, 1 to 11520, chosen by its writer from its size), a key's bucket
being (mix(key) >> 40) mod B2, and the owner of a key on N ranks (mix(key) >> 40) mod
N. The same layout with a 32-byte trailer (magic kvcoll-shard-2, no B) and an index of
(offset, count, bucket, kind, sha256) per page. read_index returns it as a format-3
index whose pages each cover [bucket, bucket] of B2.

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
import json
import math
import os
import struct

import numpy as np

from .errors import CheckpointError
from .routing import MAX_BUCKETS, bucket_of

REMOVED, ROWS = 0, 1
PAGE_BYTES = 1 << 20
MAGIC = b"kvcoll-shard-3\n\0"
MAGIC_V2 = b"kvcoll-shard-2\n\0"
_TRAILER = struct.Struct("<16sQIIII")  # MAGIC, index offset, dim, slot_floats, buckets, 0
_TRAILER_V2 = struct.Struct("<16sQII")  # MAGIC_V2, index offset, dim, slot_floats
TRAILER_BYTES = _TRAILER.size
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("count", "<u8"), ("first", "<u4"),
                        ("last", "<u4"), ("kind", "<u4"), ("sha256", "u1", (32,))])
INDEX_DTYPE_V2 = np.dtype([("offset", "<u8"), ("count", "<u8"), ("bucket", "<u4"),
                           ("kind", "<u4"), ("sha256", "u1", (32,))])
MAX_BUCKETS_V2 = 1 << 16
_WRITE_BUFFER = 8 << 20
_CHUNK = 16 << 20
_MAX_DIM = np.iinfo(np.intp).max  # the largest dimension numpy can hold
V1_ARRAYS = ("keys", "values", "slots", "last_step", "counts", "removed")


def row_bytes(dim: int, slot_floats: int) -> int:
    """Bytes of one row in a rows page (the C table's row: a 16-byte header and floats)."""
    return 16 + 4 * (dim + slot_floats)


def page_length(kind, count, dim: int, slot_floats: int):
    """Bytes of a page's payload (no padding); works on arrays of kinds and counts."""
    return np.where(np.asarray(kind) == ROWS, row_bytes(dim, slot_floats), 8) * \
        np.asarray(count, np.uint64).astype(np.int64)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def buckets_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """The bucket of each key among `buckets`: (mix(key) >> 40) mod buckets (the model
    bucket in format 3, a file's bucket in format 2)."""
    return bucket_of(keys, buckets)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    """Write `path` and fsync it (the caller renames and fsyncs the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str, fmt: str, newest: int, error, what: str, to_do: str) -> dict:
    """The JSON manifest at `path` (a checkpoint's or a published version's), checked
    for its `format` and a `version` no newer than `newest`; raises `error` naming the
    path when it is missing, corrupt, not a kvcoll `what` manifest, or too new (the fix:
    upgrade kvcoll to `to_do` it)."""
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        raise error(f"{os.path.dirname(path)} is missing or incomplete (no "
                    f"{os.path.basename(path)})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{path} is corrupt ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != fmt:
        raise error(f"{path} is not a kvcoll {what} manifest")
    version = m.get("version")
    if not isinstance(version, int) or version > newest:
        raise error(f"{path} has format version {version!r}, newer than this kvcoll's "
                    f"{newest}; upgrade kvcoll to {to_do} it")
    return m


def raw_bytes(data) -> memoryview:
    """`data` (bytes or an array of any shape, empty included) as a flat byte view."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(data).cast("B")


def _write_all(fd: int, data) -> None:
    mv = raw_bytes(data)
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


# -- format 3: write ----------------------------------------------------------------------

def _by_bucket(keys: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, the sorted buckets): keys[order] sorted by bucket, stable (so a bucket's
    keys keep the table's order); a radix sort when buckets fit 16 bits."""
    b = buckets_of(keys, buckets)
    if buckets <= MAX_BUCKETS_V2:
        b = b.astype(np.uint16)
    order = np.argsort(b, kind="stable")
    return order, b[order]


def write_shard(path: str, rows: dict, removed: np.ndarray, buckets: int) -> dict:
    """Write rows (keys, values, slots, last_step, counts) and removed keys as a format-3
    shard file of a model with `buckets` buckets, fsync it, and return what the manifest
    records: {"bytes", "rows", "removed", "pages", "index": {"offset", "bytes",
    "sha256"}}."""
    if not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(f"buckets must be in [1, {MAX_BUCKETS}], got {buckets}")
    keys = np.ascontiguousarray(rows["keys"], np.int64)
    values, slots = rows["values"], rows["slots"]
    last, counts = rows["last_step"], rows["counts"]
    removed = np.ascontiguousarray(removed, np.int64)
    n, dim, sf = keys.size, values.shape[1], slots.shape[1]
    per_page = max(1, PAGE_BYTES // row_bytes(dim, sf))
    per_removed = PAGE_BYTES // 8
    order, b_rows = _by_bucket(keys, buckets)
    rem_order, b_rem = _by_bucket(removed, buckets)
    removed = removed[rem_order]
    del rem_order

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

        for s in range(0, removed.size, per_removed):
            e = min(s + per_removed, removed.size)
            length = 8 * (e - s)
            o = room(_pad8(length))
            buf[o:o + length].view(np.int64)[:] = removed[s:e]
            entries.append(_entry(written + o, e - s, b_rem[s], b_rem[e - 1], REMOVED,
                                  buf[o:o + length]))
            buf[o + length:o + _pad8(length)] = 0
            fill = o + _pad8(length)
        for s in range(0, n, per_page):
            e = min(s + per_page, n)
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
            entries.append(_entry(written + o, e - s, b_rows[s], b_rows[e - 1], ROWS,
                                  buf[o:o + length]))
            buf[o + length:o + _pad8(length)] = 0
            fill = o + _pad8(length)
        _write_all(fd, buf[:fill])
        index_offset = written + fill
        index = np.array(entries, INDEX_DTYPE)
        head = io.BytesIO()
        np.lib.format.write_array(head, index, allow_pickle=False)
        tail = head.getvalue() + _TRAILER.pack(MAGIC, index_offset, dim, sf, buckets, 0)
        _write_all(fd, tail)
        os.fsync(fd)
    return {"bytes": index_offset + len(tail), "rows": int(n), "removed": int(removed.size),
            "pages": int(index.size),
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


def _entry(offset: int, count: int, first: int, last: int, kind: int, data) -> tuple:
    return (offset, count, int(first), int(last), kind,
            np.frombuffer(hashlib.sha256(data).digest(), np.uint8))


# -- formats 3 and 2: read ---------------------------------------------------------------

def check_size(path: str, size: int) -> None:
    """CheckpointError unless the file exists with `size` bytes."""
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if actual != size:
        raise CheckpointError(f"checkpoint file {path} has {actual} bytes, the manifest "
                              f"says {size}: it is truncated or was replaced")


def read_index(path: str, info: dict, dim: int, slot_floats: int, buckets: int,
               version: int = 3) -> np.ndarray:
    """The verified page index (INDEX_DTYPE) of a format-3 (or, with version=2, format-2)
    file whose manifest entry is `info`, of `buckets` buckets (the model's; format 2: the
    file's): size, the index's sha256, the trailer, and every entry's bounds, kind,
    buckets and counts against the manifest. Raises CheckpointError."""
    check_size(path, info["bytes"])
    ix = info["index"]
    offset, nbytes = int(ix["offset"]), int(ix["bytes"])
    trailer = TRAILER_BYTES if version >= 3 else _TRAILER_V2.size
    if offset < 0 or nbytes < trailer or offset + nbytes != info["bytes"]:
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
    return _parse_index(path, tail, offset, dim, slot_floats, buckets, info, version)


def _file_version(tail: bytes) -> int:
    """3 or 2 by the trailer's magic at the end of `tail`, else 0."""
    if len(tail) >= TRAILER_BYTES and tail[-TRAILER_BYTES:][:len(MAGIC)] == MAGIC:
        return 3
    if len(tail) >= _TRAILER_V2.size and tail[-_TRAILER_V2.size:][:len(MAGIC_V2)] == MAGIC_V2:
        return 2
    return 0


def _parse_index(path, tail: bytes, offset: int, dim, slot_floats, buckets, info=None,
                 version=None):
    """The index at the start of `tail` (the file from `offset` on), as INDEX_DTYPE.
    dim, slot_floats and buckets None: take the trailer's (format 2: buckets is
    MAX_BUCKETS_V2); version None: the trailer's."""
    found = _file_version(tail)
    if version is None:
        version = found
    if found != version or version not in (2, 3):
        raise CheckpointError(f"checkpoint file {path}: its trailer is not that of a format "
                              f"{version or 3} kvcoll shard file (corrupt, or another "
                              "kind of file)")
    if version == 3:
        _, at, t_dim, t_sf, t_buckets, _ = _TRAILER.unpack(tail[-TRAILER_BYTES:])
        trailer, dtype = TRAILER_BYTES, INDEX_DTYPE
    else:
        _, at, t_dim, t_sf = _TRAILER_V2.unpack(tail[-_TRAILER_V2.size:])
        t_buckets = buckets if buckets is not None else MAX_BUCKETS_V2
        trailer, dtype = _TRAILER_V2.size, INDEX_DTYPE_V2
    want = (offset, dim, slot_floats, buckets)
    if at != offset or (dim is not None and (t_dim, t_sf) != (dim, slot_floats)) or \
            (buckets is not None and t_buckets != buckets) or \
            not 1 <= t_buckets <= MAX_BUCKETS:
        raise CheckpointError(f"checkpoint file {path}: its trailer says index at {at}, dim "
                              f"{t_dim}, {t_sf} slot floats, {t_buckets} buckets; expected "
                              f"{', '.join(str(w) for w in want if w is not None)} (not a "
                              "matching kvcoll shard file)")
    dim, slot_floats, buckets = t_dim, t_sf, t_buckets
    fp = io.BytesIO(tail[:-trailer])
    shape, fortran, got = _npy_header(fp, path, "the index")
    if got != dtype or fortran or len(shape) != 1 or \
            fp.tell() + shape[0] * dtype.itemsize != len(tail) - trailer:
        raise CheckpointError(f"checkpoint file {path}: the index has dtype {got} and "
                              f"shape {shape}, expected {dtype} [pages]")
    raw = np.frombuffer(tail, dtype, shape[0], fp.tell())
    if version == 2:
        index = np.empty(raw.size, INDEX_DTYPE)
        for f in ("offset", "count", "kind", "sha256"):
            index[f] = raw[f]
        index["first"] = index["last"] = raw["bucket"]
    else:
        index = raw
    # offset and count are untrusted uint64: bound them before any arithmetic can wrap
    unit = np.where(index["kind"] == ROWS, row_bytes(dim, slot_floats), 8).astype(np.uint64)
    bad = (index["kind"] > ROWS) | (index["count"] == 0) | (index["last"] >= buckets) | \
        (index["first"] > index["last"]) | \
        (index["offset"] % 8 != 0) | (index["offset"] > np.uint64(offset)) | \
        (index["count"] > (np.uint64(offset) - np.minimum(index["offset"], offset)) // unit)
    length = page_length(index["kind"], np.where(bad, 0, index["count"]), dim, slot_floats)
    ends = np.where(bad, 0, index["offset"]).astype(np.int64) + length
    if index.size > 1:
        bad[1:] |= index["offset"][1:].astype(np.int64) < ends[:-1]
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CheckpointError(f"checkpoint file {path}: index entry {i} ({raw[i]}) is "
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
        # a zero-size record still needs every dimension to fit numpy's intp
        if fortran or end > buf.size or not plain or min(shape, default=0) < 0 or \
                max(shape, default=0) > _MAX_DIM:
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


# -- any format, without a manifest ----------------------------------------------------------

def read_shard(path: str) -> dict:
    """A shard file's arrays by name (keys, values, slots, last_step, counts, removed),
    in file order, from any format. Format 3 and 2 pages are checked against their own
    index's sha256; the index itself (and a format-1 file) is verified only by a
    restore, against the manifest."""
    with open(path, "rb") as f:
        data = f.read()
    version = _file_version(data)
    if not version:
        buf = np.frombuffer(data, np.uint8)
        return check_records_v1(parse_records_v1(buf, path), path, None, None)
    trailer = TRAILER_BYTES if version == 3 else _TRAILER_V2.size
    _, offset, dim, sf = _TRAILER_V2.unpack(data[-trailer:][:_TRAILER_V2.size])
    if offset > len(data) - trailer:
        raise CheckpointError(f"checkpoint file {path}: its trailer puts the index at byte "
                              f"{offset}, past the end of its {len(data)} bytes (corrupt)")
    index = _parse_index(path, data[offset:], offset, None, None, None, version=version)
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
