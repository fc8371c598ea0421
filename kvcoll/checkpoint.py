"""Checkpoints: full and incremental saves that restore on any world size.

    kv.save(ckpt_dir, model)                       # full: every row, the dense model
    kv.save(ckpt_dir, model, incremental=True)     # only rows changed since the last save
    kv.restore(ckpt_dir, model)                    # latest, on any number of ranks

(model: a Keras model with kv.Embedding layers, or a kv.Trainer.)

All three are collectives: every rank calls them with the same arguments.

Layout of a checkpoint directory:

    DIR/latest                       the name of the newest complete checkpoint + "\\n"
    DIR/ckpt-0000000400/             one checkpoint (full or delta), complete
        manifest.json                format, version, kind, parent, step, world size,
                                     table specs, every file with its sha256 and size
        dense.index, dense.data-*    the Keras model and its optimizer (tf.train.Checkpoint)
        000-user.r1-of-2.kvs         table "user", written by rank 1 of 2
    DIR/ckpt-0000000500.tmp-<hex>/   a save in progress, or one a crash abandoned

A shard file (`.kvs`) is a sequence of six NumPy `.npy` records, one after the other,
for the rows a rank owned: keys int64 [n], values float32 [n, dim], slots float32
[n, slot_floats] (the row optimizer's state), last_step uint32 [n], counts uint32 [n]
(the row headers), and removed int64 [m] (keys evicted or deleted since the parent
checkpoint, unique; always empty in a full checkpoint). Read it with
`read_shard(path)` or any .npy reader that reads several arrays from one file.

Atomicity. Every rank writes its files under the temporary directory and fsyncs them;
the ranks agree that every part is durable; only then does rank 0 write the manifest,
rename the directory to its final name, fsync the parent and replace `latest`
atomically (write latest.tmp, fsync, rename). A crash or kill at any moment leaves
the previous checkpoint and `latest` intact; a leftover `.tmp-` directory is ignored
and removed by the next save. Only one job may save into a directory at a time. With
several hosts, DIR must be a shared file system (every rank writes there, every rank
reads the files it needs on restore).

Incremental saves. A delta holds the rows whose dirty bit is set (created or updated
since the previous save: the C export reads a row's value, slots and header in one
pass under the table lock and clears the bit) and names its parent; restore replays
the full checkpoint, then each delta in order. If a save fails after the dirty bits
were cleared, the next save is a full one, so no change is ever lost. A delta needs
its parent in the same directory and written or restored by this process; otherwise
`incremental=True` writes a full checkpoint (`SaveInfo.kind` says which).

Removals. From its first save on, a Checkpointer keeps each table's removed-keys log
on (KvTable.track_removed): every key evicted or deleted is logged in C, and each save
drains the log (KvTable.take_removed) into the shard's `removed` array (a full save
drains and drops it). Replay applies a delta's removals before its rows, so a key
evicted and then created again before the save ends up present, and one evicted for
good ends up absent. A save must not run concurrently with table changes (BSP saves
run between steps).

Restore on any world size. A shard written by rank s of W holds the keys with
owner_of(key, W) == s. On M ranks, each rank reads its own file when M == W and every
file otherwise, and keeps the keys it owns under the new partition. Everything (the
chain of manifests, the format version, the table specs against the trainer's
tables, every file's size and sha256, the dense variables' names and shapes) is
checked before any table or variable changes, and every rank raises the same
CheckpointError if any rank found a problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import time
import weakref

import numpy as np

from .errors import CheckpointError
from .routing import owner_of
from .table import KvTable

__all__ = ["save", "restore", "latest", "Checkpointer", "SaveInfo", "RestoreInfo",
           "read_shard", "FORMAT", "VERSION"]

FORMAT = "kvcoll-checkpoint"
VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
SHARD_ARRAYS = ("keys", "values", "slots", "last_step", "counts", "removed")
_DENSE_PREFIX = "dense"
_NAME_RE = re.compile(r"^ckpt-\d{10}(-\d+)?$")
_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """What a save wrote: its directory, kind ("full" or "delta"), the rows written over
    all ranks, the bytes of every file, and the seconds it took."""

    path: str
    name: str
    kind: str
    step: int
    rows: int
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """What a restore read: the checkpoint, its step, the chain replayed (full first),
    the rows this rank now holds and the bytes it read."""

    path: str
    name: str
    step: int
    chain: tuple
    rows: int
    bytes: int
    seconds: float


# -- files -----------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _byte_view(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def _write_shard(path: str, arrays: list) -> tuple[str, int]:
    """Write arrays as consecutive .npy records, fsync, return (sha256, bytes)."""
    h = hashlib.sha256()
    total = 0
    with open(path, "xb", buffering=0) as f:
        for arr in arrays:
            arr = np.ascontiguousarray(arr)
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                head, np.lib.format.header_data_from_array_1_0(arr))
            for part in (memoryview(head.getbuffer()), _byte_view(arr) if arr.size else b""):
                for at in range(0, len(part), _CHUNK):
                    chunk = part[at:at + _CHUNK]
                    h.update(chunk)
                    mv = memoryview(chunk)
                    while mv:  # raw writes may be short
                        mv = mv[f.write(mv):]
                total += len(part)
        os.fsync(f.fileno())
    return h.hexdigest(), total


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_verified(path: str, sha256: str, size: int) -> np.ndarray:
    """The whole file as uint8, after checking its size and sha256."""
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if actual != size:
        raise CheckpointError(f"checkpoint file {path} has {actual} bytes, the manifest "
                              f"says {size}: it is truncated or was replaced")
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


def _sha256_file(path: str) -> tuple[str, int]:
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


def _parse_records(buf: np.ndarray, path: str) -> list[np.ndarray]:
    """The .npy records of a shard file's bytes, as views into buf."""
    out = []
    at = 0
    raw = memoryview(buf)
    while at < buf.size:
        fp = io.BytesIO(raw[at:at + 65536 + 16].tobytes())
        try:
            major, _ = np.lib.format.read_magic(fp)
            read = np.lib.format.read_array_header_1_0 if major == 1 \
                else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(fp)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint file {path}: record {len(out)} is not a "
                                  f".npy record ({exc})") from None
        start = at + fp.tell()
        count = int(np.prod(shape, dtype=np.int64))
        end = start + count * dtype.itemsize
        if fortran or end > buf.size or dtype.hasobject:
            raise CheckpointError(f"checkpoint file {path}: record {len(out)} is malformed")
        out.append(buf[start:end].view(dtype).reshape(shape))
        at = end
    return out


def read_shard(path: str) -> dict:
    """A shard file's arrays by name (keys, values, slots, last_step, counts, removed),
    without checksum verification (restore verifies against the manifest)."""
    with open(path, "rb") as f:
        buf = np.frombuffer(f.read(), np.uint8)
    return _check_records(_parse_records(buf, path), path, None, None)


def _check_records(records: list, path: str, dim, slot_floats) -> dict:
    if len(records) != len(SHARD_ARRAYS):
        raise CheckpointError(f"checkpoint file {path}: {len(records)} arrays, expected "
                              f"{len(SHARD_ARRAYS)} ({', '.join(SHARD_ARRAYS)})")
    a = dict(zip(SHARD_ARRAYS, records))
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
    return a


# -- specs -----------------------------------------------------------------------------

def _table_spec(t: KvTable) -> dict:
    return {"dim": t.dim, "slot_floats": t.slot_floats,
            "optimizer": t.optimizer._c_fields()["kind"],
            "optimizer_config": repr(t.optimizer),
            "initializer": dataclasses.astuple(t.initializer), "seed": t.seed}


def _check_specs(manifest: dict, tables: dict, where: str) -> None:
    saved = manifest["tables"]
    if set(saved) != set(tables):
        raise CheckpointError(
            f"{where}: its tables {sorted(saved)} are not the model's {sorted(tables)} "
            "(another table layout); restore it into the model that wrote it")
    for name, t in tables.items():
        s, mine = saved[name], _table_spec(t)
        if s["dim"] != mine["dim"]:
            raise CheckpointError(
                f"{where}: table {name!r} has dim {s['dim']} in the checkpoint but "
                f"{mine['dim']} in the model; the dims must match")
        if s["optimizer"] != mine["optimizer"] or s["slot_floats"] != mine["slot_floats"]:
            raise CheckpointError(
                f"{where}: table {name!r} was saved with row optimizer {s['optimizer']!r} "
                f"({s['slot_floats']} slot floats per row), the model uses "
                f"{mine['optimizer']!r} ({mine['slot_floats']}); use the same optimizer kind")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


# -- the dense part ----------------------------------------------------------------------

class _KerasDense:
    """The Keras model and its optimizer through tf.train.Checkpoint (rank 0 writes,
    every rank reads)."""

    def __init__(self, model, optimizer):
        import tensorflow as tf

        self._tf = tf
        self._ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)

    def write(self, directory: str) -> list[str]:
        self._ckpt.write(os.path.join(directory, _DENSE_PREFIX))
        return sorted(f for f in os.listdir(directory) if f.startswith(_DENSE_PREFIX + "."))

    def _listing(self, prefix: str) -> dict:
        return {n: tuple(s) for n, s in self._tf.train.list_variables(prefix)
                if not n.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}

    def check(self, directory: str) -> None:
        """Raise CheckpointError unless the saved variables are exactly this model's
        (same names, same shapes)."""
        import tempfile

        try:
            saved = self._listing(os.path.join(directory, _DENSE_PREFIX))
        except Exception as exc:  # noqa: BLE001 - TF raises several kinds
            raise CheckpointError(f"{directory}: the dense checkpoint cannot be read "
                                  f"({type(exc).__name__}: {exc})") from None
        with tempfile.TemporaryDirectory() as tmp:
            mine = self._listing(self._ckpt.write(os.path.join(tmp, "probe")))
        if saved != mine:
            extra = sorted(set(saved) - set(mine))[:3]
            missing = sorted(set(mine) - set(saved))[:3]
            shapes = sorted(n for n in set(saved) & set(mine) if saved[n] != mine[n])[:3]
            raise CheckpointError(
                f"{directory}: the dense model or optimizer differs from the checkpoint's "
                f"(only in the checkpoint: {extra}, only in the model: {missing}, other "
                f"shapes: {shapes}); build the same model and optimizer")

    def read(self, directory: str) -> None:
        self._ckpt.read(os.path.join(directory, _DENSE_PREFIX)).assert_existing_objects_matched()


# -- the checkpointer ----------------------------------------------------------------------

class Checkpointer:
    """Saves and restores a fixed set of tables (and optionally a dense part) on a
    communicator. Keeps the incremental chain: the checkpoint the tables' dirty bits
    are relative to. kv.save / kv.restore keep one per Trainer; use this class
    directly for tables without a Keras model (bench, engine-only scripts)."""

    def __init__(self, tables: dict, comm, dense=None):
        self.tables = dict(tables)
        self.comm = comm
        self.dense = dense
        self._parent = None  # (abs dir, checkpoint name) the dirty bits are relative to

    # -- save ------------------------------------------------------------------------

    def save(self, directory, step: int, *, incremental: bool = False) -> SaveInfo:
        """Write a checkpoint of the tables (and the dense part) at `step`. A collective."""
        t0 = time.perf_counter()
        comm = self.comm
        directory = os.path.abspath(os.fspath(directory))
        plan = self._plan(directory, int(step), incremental) if comm.rank == 0 else None
        plan = json.loads(comm.bcast_bytes(
            json.dumps(plan).encode() if comm.rank == 0 else None, op="checkpoint:plan"))
        if "error" in plan:
            raise CheckpointError(plan["error"])
        tmp = os.path.join(directory, plan["tmp"])
        delta = plan["kind"] == "delta"
        # From here the dirty bits may be cleared: until this save commits, the next
        # one must be full.
        self._parent = None
        files, err = {}, None
        try:
            for i, (name, t) in enumerate(self.tables.items()):
                t.track_removed(True)  # from now on removals are logged for the next delta
                logged = t.take_removed()  # a full save holds every live row: drop it
                removed = np.unique(logged) if delta else np.zeros(0, np.int64)
                rows = t.export(dirty_only=delta, clear_dirty=True)
                fname = f"{i:03d}-{_safe(name)}.r{comm.rank}-of-{comm.size}.kvs"
                arrays = [rows["keys"], rows["values"], rows["slots"], rows["last_step"],
                          rows["counts"], removed]
                sha, nbytes = _write_shard(os.path.join(tmp, fname), arrays)
                files[fname] = {"sha256": sha, "bytes": nbytes, "table": name,
                                "rank": comm.rank, "world": comm.size,
                                "rows": int(rows["keys"].size)}
                del rows, arrays
            if comm.rank == 0 and self.dense is not None:
                for fname in self.dense.write(tmp):
                    path = os.path.join(tmp, fname)
                    with open(path, "rb+") as f:
                        os.fsync(f.fileno())
                    sha, nbytes = _sha256_file(path)
                    files[fname] = {"sha256": sha, "bytes": nbytes, "table": None}
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"rank {comm.rank}: saving {tmp} failed: {type(exc).__name__}: {exc}"
        gathered = comm.allgather_json({"files": files, "error": err}, "checkpoint:files")
        errors = [g["error"] for g in gathered if g["error"]]
        result = None
        if comm.rank == 0:
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                result = self._commit(directory, plan, step, gathered)
        result = json.loads(comm.bcast_bytes(
            json.dumps(result).encode() if comm.rank == 0 else None, op="checkpoint:commit"))
        if errors:
            raise CheckpointError(errors[0] + " (the previous checkpoint is intact)")
        if "error" in result:
            raise CheckpointError(result["error"])
        self._parent = (directory, plan["name"])
        return SaveInfo(os.path.join(directory, plan["name"]), plan["name"], plan["kind"],
                        int(step), result["rows"], result["bytes"], time.perf_counter() - t0)

    def _plan(self, directory: str, step: int, incremental: bool) -> dict:
        """Rank 0: the kind, the final and the temporary name; creates the tmp dir."""
        try:
            os.makedirs(directory, exist_ok=True)
            for entry in os.listdir(directory):  # saves a crash abandoned
                if entry.startswith("ckpt-") and ".tmp-" in entry:
                    shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            parent = None
            if incremental and self._parent is not None and self._parent[0] == directory \
                    and os.path.isfile(os.path.join(directory, self._parent[1], MANIFEST)):
                parent = self._parent[1]
            name = f"ckpt-{step:010d}"
            k = 0
            while os.path.exists(os.path.join(directory, name)):
                k += 1
                name = f"ckpt-{step:010d}-{k}"
            tmp = f"{name}.tmp-{secrets.token_hex(6)}"
            os.mkdir(os.path.join(directory, tmp))
        except OSError as exc:
            return {"error": f"cannot create a checkpoint in {directory}: {exc}"}
        return {"name": name, "tmp": tmp, "kind": "delta" if parent else "full",
                "parent": parent}

    def _commit(self, directory: str, plan: dict, step: int, gathered: list) -> dict:
        """Rank 0, once every rank's files are durable: manifest, rename, latest."""
        tmp = os.path.join(directory, plan["tmp"])
        try:
            files = {}
            for g in gathered:
                files.update(g["files"])
            tables = {}
            for name, t in self.tables.items():
                tables[name] = {**_table_spec(t),
                                "files": sorted(f for f, v in files.items()
                                                if v["table"] == name),
                                "rows": sum(v["rows"] for v in files.values()
                                            if v["table"] == name)}
            manifest = {
                "format": FORMAT, "version": VERSION, "kind": plan["kind"],
                "parent": plan["parent"], "step": int(step), "world_size": self.comm.size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "checksum": "sha256", "tables": tables,
                "dense": sorted(f for f, v in files.items() if v["table"] is None) or None,
                "files": {f: {k: v[k] for k in ("sha256", "bytes", "rank", "world") if k in v}
                          for f, v in sorted(files.items())},
            }
            _write_bytes(os.path.join(tmp, MANIFEST),
                         (json.dumps(manifest, indent=1) + "\n").encode())
            _fsync_dir(tmp)
            final = os.path.join(directory, plan["name"])
            os.rename(tmp, final)
            _fsync_dir(directory)
            _write_bytes(os.path.join(directory, LATEST + ".tmp"), (plan["name"] + "\n").encode())
            os.replace(os.path.join(directory, LATEST + ".tmp"), os.path.join(directory, LATEST))
            _fsync_dir(directory)
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            return {"error": f"committing the checkpoint in {directory} failed: "
                             f"{type(exc).__name__}: {exc} (the previous checkpoint is intact)"}
        return {"rows": sum(t["rows"] for t in tables.values()),
                "bytes": sum(v["bytes"] for v in files.values())}

    # -- restore ---------------------------------------------------------------------

    def restore(self, directory, checkpoint: str | None = None) -> RestoreInfo:
        """Replace the tables (and the dense part) with a checkpoint's state: `latest`
        unless `checkpoint` names one. A collective; on any problem every rank raises
        CheckpointError and nothing has changed."""
        t0 = time.perf_counter()
        comm = self.comm
        directory = os.path.abspath(os.fspath(directory))
        err, loaded = None, None
        try:
            loaded = self._load(directory, checkpoint)
        except CheckpointError as exc:
            err = f"rank {comm.rank}: {exc}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            err = f"rank {comm.rank}: {directory}: unreadable checkpoint " \
                  f"({type(exc).__name__}: {exc})"
        errors = [e for e in comm.allgather_json(err, "checkpoint:verify") if e]
        if errors:
            raise CheckpointError(errors[0] + "; nothing was restored")
        chain, per_ckpt, nbytes = loaded
        # Verified everywhere: now change things.
        self._parent = None
        for name, t in self.tables.items():
            t.clear()
            for rows in per_ckpt:
                r = rows[name]
                if r["removed"].size:  # removals first: a re-created key stays
                    t.delete(r["removed"])
                if r["keys"].size:
                    t.import_(r["keys"], r["values"], slots=r["slots"],
                              last_step=r["last_step"], counts=r["counts"])
            t.track_removed(True)  # the next delta's removals are relative to this one
            t.take_removed()
        last = chain[-1]
        if self.dense is not None:
            self.dense.read(os.path.join(directory, last["_name"]))
        comm.barrier("checkpoint:restored")
        self._parent = (directory, last["_name"])
        return RestoreInfo(os.path.join(directory, last["_name"]), last["_name"], last["step"],
                           tuple(m["_name"] for m in chain),
                           sum(len(t) for t in self.tables.values()), nbytes,
                           time.perf_counter() - t0)

    def _load(self, directory: str, checkpoint: str | None):
        """Read and verify everything this rank needs; change nothing."""
        if checkpoint is None:
            try:
                with open(os.path.join(directory, LATEST)) as f:
                    checkpoint = f.read().strip()
            except FileNotFoundError:
                raise CheckpointError(f"{directory} has no checkpoint (no '{LATEST}' file)") \
                    from None
        chain = []
        name = checkpoint
        while True:
            if not _NAME_RE.match(name or "") or len(chain) > 100000:
                raise CheckpointError(f"{directory}: {name!r} is not a checkpoint name")
            m = _read_manifest(directory, name)
            chain.insert(0, m)
            if m["kind"] == "full":
                break
            name = m["parent"]
        for m in chain:
            _check_specs(m, self.tables, os.path.join(directory, m["_name"]))
        last = chain[-1]
        if self.dense is not None:
            if not last.get("dense"):
                raise CheckpointError(f"{os.path.join(directory, last['_name'])} holds no "
                                      "dense model; it was saved without one")
            for fname in last["dense"]:
                info = last["files"][fname]
                _read_verified(os.path.join(directory, last["_name"], fname),
                               info["sha256"], info["bytes"])
            self.dense.check(os.path.join(directory, last["_name"]))
        rank, world = self.comm.rank, self.comm.size
        per_ckpt, nbytes = [], 0
        for m in chain:
            rows = {}
            for name, t in self.tables.items():
                parts = []
                for fname in m["tables"][name]["files"]:
                    info = m["files"].get(fname)
                    if info is None:
                        raise CheckpointError(f"{m['_name']}: {fname} is not in the manifest")
                    if info["world"] == world and info["rank"] != rank:
                        continue  # same partition: only this rank's own file
                    path = os.path.join(directory, m["_name"], fname)
                    buf = _read_verified(path, info["sha256"], info["bytes"])
                    nbytes += buf.size
                    a = _check_records(_parse_records(buf, path), path, t.dim, t.slot_floats)
                    if info["world"] != world:  # another partition: keep what is ours now
                        keep = owner_of(a["keys"], world) == rank
                        a = {k: v[owner_of(v, world) == rank] if k == "removed" else v[keep]
                             for k, v in a.items()}
                    parts.append(a)
                if len(parts) == 1:
                    rows[name] = parts[0]
                else:
                    rows[name] = {k: np.concatenate([p[k] for p in parts]) if parts else
                                  _empty(k, t) for k in SHARD_ARRAYS}
            per_ckpt.append(rows)
        return chain, per_ckpt, nbytes


def _empty(name: str, t: KvTable) -> np.ndarray:
    return {"keys": np.zeros(0, np.int64), "values": np.zeros((0, t.dim), np.float32),
            "slots": np.zeros((0, t.slot_floats), np.float32),
            "last_step": np.zeros(0, np.uint32), "counts": np.zeros(0, np.uint32),
            "removed": np.zeros(0, np.int64)}[name]


def _read_manifest(directory: str, name: str) -> dict:
    path = os.path.join(directory, name, MANIFEST)
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"{os.path.join(directory, name)} is missing or incomplete "
                              f"(no {MANIFEST})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a kvcoll checkpoint manifest")
    version = m.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"{path} has format version {version!r}, newer than this kvcoll's {VERSION}; "
            "upgrade kvcoll to restore it")
    if m.get("kind") not in ("full", "delta") or (m["kind"] == "delta" and not m.get("parent")):
        raise CheckpointError(f"{path}: kind {m.get('kind')!r} / parent {m.get('parent')!r} "
                              "are not valid")
    m["_name"] = name
    return m


# -- kv.save / kv.restore ----------------------------------------------------------------

_checkpointers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _engine(obj):
    """The step engine behind a Keras model, a kv.Trainer, or an engine, set up."""
    from .keras.engine import Engine, engine_of

    eng = obj if isinstance(obj, Engine) else getattr(obj, "engine", None)
    if eng is None:
        eng = engine_of(obj)
    if eng.tables is None:
        eng.setup_from_model()
    return eng


def _checkpointer(eng) -> Checkpointer:
    ck = _checkpointers.get(eng)
    if ck is None:
        ck = Checkpointer(eng.tables, eng.comm, dense=_KerasDense(eng.model, eng.optimizer))
        _checkpointers[eng] = ck
    return ck


def latest(directory) -> str | None:
    """The name of the newest complete checkpoint in `directory`, or None."""
    try:
        with open(os.path.join(os.fspath(directory), LATEST)) as f:
            return f.read().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def save(directory, model, *, incremental: bool = False) -> SaveInfo:
    """Checkpoint a model with kv.Embedding layers (or a kv.Trainer) at its current
    step (a collective).

    Full by default: every row of every table (values, optimizer slots, row headers),
    the Keras model and its optimizer, the step. incremental=True writes only the rows
    changed since this model's previous save (or restore) in the same directory;
    without one it writes a full checkpoint. In SSP/ASP every rank first waits until
    every update is applied (a sync point), so the checkpoint is consistent. Returns a
    SaveInfo."""
    eng = _engine(model)
    eng.sync()
    return _checkpointer(eng).save(directory, eng.step, incremental=incremental)


def restore(directory, model, *, checkpoint: str | None = None) -> RestoreInfo:
    """Restore a model with kv.Embedding layers (or a kv.Trainer) from `directory`'s
    latest checkpoint (or `checkpoint`, a name such as "ckpt-0000000400"), on any number
    of ranks (a collective). Tables, dense model, optimizer and step become the saved
    ones, bit for bit, and training continues from that step in every step mode; any
    mismatch or corruption raises CheckpointError on every rank before anything
    changes."""
    eng = _engine(model)
    eng.sync()
    info = _checkpointer(eng).restore(directory, checkpoint)
    eng.set_step(info.step)
    return info
