"""Checkpoints: full and incremental saves that restore on any world size, streaming.

`Checkpointer(tables, comm, dense=...)` saves and restores this rank's table shards
(and, through `dense`, any object that writes and reads the dense part: the Keras
package's DenseState); no TensorFlow here. What a user calls is in kvcoll.keras.saving:

    kv.save(ckpt_dir, model)                       # full: every row, the dense model
    kv.save(ckpt_dir, model, incremental=True)     # only rows changed since the last save
    kv.restore(ckpt_dir, model)                    # latest, on any number of ranks

All are collectives: every rank calls them with the same arguments.

Layout of a checkpoint directory:

    DIR/latest                       the name of the newest complete checkpoint + "\\n"
    DIR/ckpt-0000000400/             one checkpoint (full or delta), complete
        manifest.json                format, version, kind, parent, step, world size,
                                     the model's bucket count and the owner map of the
                                     run that wrote it, table specs, every file with its
                                     size and sha256 (a shard file: its index's and its
                                     rows), id_hash: how string ids became keys
                                     (kvcoll.ids; absent: "xxh64", what kvcoll used before)
        dense.index, dense.data-*    the Keras model and its optimizer (kvcoll.keras.dense_state)
        000-user.r1-of-2.kvs         table "user", written by rank 1 of 2
    DIR/ckpt-0000000500.tmp-<hex>/   a save in progress, or one a crash abandoned

A shard file (`.kvs`, format version 3) holds the rows a rank owned, and (in a delta)
the keys removed since the parent, sorted by the model's bucket (kvcoll.routing: a
key's bucket is (mix(key) >> 40) mod B, B = 65,536 for the life of the model; its
owner is the owner map's rank of that bucket) in pages of at most 1 MiB, each covering
a run of buckets. The manifest records B ("buckets") and the map ("owners": runs of
consecutive buckets of one rank, kvcoll.routing.OwnerMap.to_json), so a restore knows
which file holds which buckets without opening it. An index at the end of the file
gives every page's first and last bucket, offset, count and sha256; kvcoll._shards
describes the bytes. `read_shard(path)` reads one file whole.

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
its parent in the same directory, written or restored by this process, in the same
format; otherwise `incremental=True` writes a full checkpoint (`SaveInfo.kind` says
which).

Removals. From its first save on, a Checkpointer keeps each table's removed-keys log
on (KvTable.track_removed): every key evicted or deleted is logged in C, and each save
drains the log (KvTable.take_removed) into the shard's removed pages (a full save
drains and drops it). Replay applies a delta's removals before its rows, so a key
evicted and then created again before the save ends up present, and one evicted for
good ends up absent. A save must not run concurrently with table changes (BSP saves
run between steps).

Restore on any world size and any map, in bounded memory. A restore routes by the
Checkpointer's owner map (`owners=`, by default the even map of the world size, the
one the exchanges use): rank r reads, from each checkpoint of the chain, the index of
each file whose writer owned a bucket that r owns now (by that checkpoint's map), then
only the pages whose buckets meet r's; when a page also holds buckets of another rank
it keeps only its own keys. On the map that wrote the checkpoint, that is its own files
and nothing else. It reads in two passes through buffers of `buffer_bytes` / 4
(default RESTORE_BUFFER = 256 MiB; at least MIN_RESTORE_BUFFER):
1. verify: the chain of manifests, the format version, the bucket count, the maps, the
   table specs against the tables, every file's size, every index's and every page's
   sha256, every page's buckets against its writer's map, every key's bucket against
   its page's, the dense variables' names and shapes. Nothing changes; every rank
   raises the same CheckpointError if any rank found a problem.
2. replay, group by group: a group is a run of consecutive buckets whose pages over
   the whole chain fill about the buffer; the pages that meet it are read (and their
   sha256 checked again), then applied in chain order (each checkpoint's removals,
   then its rows), straight from the buffer into the table, a page that reaches
   outside the group keeping only the group's keys (it is read again for the next
   group: about one page per group and checkpoint). Keys of different buckets never
   meet, so replaying group by group equals replaying checkpoint by checkpoint; a row
   that a later delta removes lives at most until the end of its group. A chain
   without removals is one group.
The memory bound. Beyond the tables it fills, a restore holds two read buffers of
buffer_bytes / 4 (pass 2 reads and verifies the next batch on a thread while it
applies this one; when all the rank's pages fit in one, pass 1 keeps them and pass 2
reads nothing), the rows of the current group that a later delta removes (about
buffer_bytes / 4: a file row is a table row), a page's copies when it filters by key,
and its plan (about 200 bytes per page it reads): at most about buffer_bytes in all,
whatever the number of ranks that wrote the checkpoint or the length of the chain.
Two things are outside it: the C table's own growth (it builds its new index before it
frees the old one: under 5 bytes a row, once), and a bucket whose pages over the chain
exceed buffer_bytes / 4 (a group is at least one bucket), whose rows a later delta
removes may live until the end of the bucket: 1/65,536 of the table, so only in a
table above 65,536 x 64 MiB = 4 TB with the default buffer. If a file changes between
the two passes, every rank clears its tables and raises CheckpointError: restore again.

Version 2 checkpoints (each file with its own bucket count, keys routed by (mix(key)
>> 40) mod world) still restore: a page of bucket b of B holds keys whose model bucket
is b mod gcd(B, 65,536), so a rank reads the pages of the residues it owns, and keeps
its own keys; with the even map that is every page of every file (each rank owns a
contiguous block of buckets, which meets every residue): restoring a version 2
checkpoint reads it all on every rank once, still in bounded memory. The next save
is full and in the current version. Replay groups go by the residues modulo the gcd of the
chain's bucket counts.

Version 4 is version 3 and, in the manifest, every saving rank's progress (where its
data stood at the saved step: the epoch, the step in it, its reader's position, see
kvcoll.data.position), which a restore hands back in RestoreInfo.progress; version 3
checkpoints restore with no progress.

Version 1 checkpoints (whole-file checksums, no buckets) still restore, through the
old reader: every rank reads every file whole, in memory, and keeps its own keys
(their files were routed by world size, not by the map).
`Checkpointer(version=1)` writes them, for a kvcoll that reads only version 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import time

import numpy as np

from . import _shards, ids
from .errors import CheckpointError, InvalidArgumentError, NonFiniteError
from .routing import OwnerMap, bucket_of, owners_for
from .table import KvTable, first_nonfinite_row

__all__ = ["latest", "check_shared", "Checkpointer", "SaveInfo", "RestoreInfo",
           "read_shard", "FORMAT", "VERSION", "RESTORE_BUFFER", "MIN_RESTORE_BUFFER"]

FORMAT = "kvcoll-checkpoint"
VERSION = 4
RESTORE_BUFFER = 256 << 20
MIN_RESTORE_BUFFER = 4 * _shards.PAGE_BYTES
LATEST = "latest"
MANIFEST = "manifest.json"
SHARD_ARRAYS = _shards.V1_ARRAYS
_NAME_RE = re.compile(r"^ckpt-\d{10}(-\d+)?$")

read_shard = _shards.read_shard


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
    the rows this rank now holds, the bytes it read (each once: indexes, its pages,
    the dense part) and the seconds it took."""

    path: str
    name: str
    step: int
    chain: tuple
    rows: int
    bytes: int
    seconds: float
    progress: tuple = ()   # every saving rank's progress (format 4), by rank; () before


# -- files -----------------------------------------------------------------------------

def _write_shard(path: str, rows: dict, removed: np.ndarray, buckets: int) -> dict:
    """One table's shard file of this rank (format 3; tests replace it to fail a save)."""
    return _shards.write_shard(path, rows, removed, buckets)


def _check_owned(name: str, keys: np.ndarray, owners: OwnerMap, rank: int) -> None:
    """InvalidArgumentError unless the owner map gives every key to `rank`: a file holds
    only its writer's buckets (what a restore reads by)."""
    theirs = owners.owner_of(keys) != rank
    if theirs.any():
        raise InvalidArgumentError(
            f"table {name!r} on rank {rank} holds {int(theirs.sum())} keys that the owner "
            f"map gives other ranks (e.g. {int(keys[theirs][0])}): the Checkpointer's "
            "owners= must be the map the tables were filled by (the exchange's .owners)")


def _check_finite(name: str, rows: dict, rank: int) -> None:
    """NonFiniteError unless every row's values and slots are finite: a restore refuses
    NaN/Inf, so a checkpoint holding one could not be restored (the save fails on every
    rank, and the previous checkpoint stays the latest)."""
    for column, what in (("values", "embedding"), ("slots", "optimizer slots")):
        arr = rows.get(column)
        at = -1 if arr is None or not arr.size else first_nonfinite_row(arr)
        if at >= 0:
            raise NonFiniteError(
                f"table {name!r}: key {int(rows['keys'][at])} on rank {rank} has a NaN/Inf "
                f"in its {what}: a checkpoint holding it could not be restored, so none is "
                "written; delete the key (KvTable.delete) or restore an earlier checkpoint")


ADMISSION_ARRAYS = ("keys", "counts", "steps", "bloom", "bloom_adds")


def _write_admission(tmp: str, shard: str, t: KvTable, name: str, comm) -> dict:
    """The table's admission state on this rank (exact pending counts, or the Bloom
    filter) into `<shard file>.adm`, as of this save: every checkpoint, full or delta,
    holds it whole, so a restore admits exactly as the saved run would have."""
    a = t.export_admission()
    arrays = [a["keys"], a["counts"], a["steps"],
              a["bloom"] if a["bloom"] is not None else np.zeros(0, np.uint8),
              np.array([a["bloom_adds"]], np.int64)]
    fname = shard + ".adm"
    sha, nbytes = _shards.write_shard_v1(os.path.join(tmp, fname), arrays)
    return {fname: {"sha256": sha, "bytes": nbytes, "table": name, "rank": comm.rank,
                    "world": comm.size, "rows": 0, "admission": True}}


def _read_admission(directory: str, m: dict, tables: dict, comm, owners=None,
                    only=None) -> dict:
    """{table: admission state for this rank} from checkpoint m (verified), under the
    owner map `owners` (default: the even map of comm.size): its own file when m was
    written on the same map; else the pending keys it now owns from every file whose
    writer owned one of its buckets (every file before version 3, routed by world
    size), and their Bloom filters merged (never admits later than the saved run).
    only: a bool mask of buckets (Checkpointer.refill): the keys of those alone."""
    owners = owners_for(comm, owners)
    writers = _manifest_owners(m, owners) if m.get("version", 0) >= 3 else None
    mine = owners.array == comm.rank
    if only is not None:
        mine = mine & only
    same = writers is not None and writers == owners and only is None
    meets = None if writers is None else \
        np.bincount(writers.array[mine], minlength=writers.world) > 0
    out = {}
    for name, t in tables.items():
        adm = [f for f in m["tables"][name].get("admission", [])]
        if not adm or t.admit_min_count < 2:
            continue
        parts = []
        for fname in adm:
            info = m["files"][fname]
            if same and info["rank"] != comm.rank:
                continue
            if meets is not None and not meets[_writer_rank(info, writers, m, fname)]:
                continue  # its writer owned none of this rank's buckets
            path = os.path.join(directory, m["_name"], fname)
            buf = _shards.read_verified(path, info["sha256"], info["bytes"])
            recs = _check_admission(path, _shards.parse_records_v1(buf, path), t)
            if not same:
                keep = mine[bucket_of(recs["keys"], owners.buckets)]
                recs.update(keys=recs["keys"][keep], counts=recs["counts"][keep],
                            steps=recs["steps"][keep])
            parts.append(recs)
        if not parts:
            continue
        blooms = [p["bloom"] for p in parts if p["bloom"].size]
        state = {"keys": np.concatenate([p["keys"] for p in parts]),
                 "counts": np.concatenate([p["counts"] for p in parts]),
                 "steps": np.concatenate([p["steps"] for p in parts]),
                 "bloom": None, "bloom_adds": 0, "merge": len(parts) > 1}
        if blooms:
            if any(b.size != blooms[0].size for b in blooms):
                raise CheckpointError(f"{m['_name']}: table {name!r}: Bloom filters of "
                                      "different sizes")
            state["bloom"] = np.maximum.reduce([_nibbles(b) for b in blooms]).astype(np.uint8)
            state["bloom"] = _pack_nibbles(state["bloom"])
            state["bloom_adds"] = int(max(int(p["bloom_adds"][0]) for p in parts))
        out[name] = state
    return out


def _manifest_owners(m: dict, owners: OwnerMap) -> OwnerMap:
    """The owner map of the run that wrote version-3 checkpoint m, checked against the
    manifest's world size and against the current map's bucket count."""
    where = os.path.join(m["_name"], MANIFEST)
    buckets = m.get("buckets")
    try:
        writers = OwnerMap.from_json(m.get("owners"))
    except InvalidArgumentError as exc:
        raise CheckpointError(f"{where}: its owner map is not valid ({exc}): corrupt "
                              "manifest; restore an earlier checkpoint") from None
    if buckets != writers.buckets or m.get("world_size") != writers.world:
        raise CheckpointError(f"{where}: its owner map has {writers.buckets} buckets over "
                              f"{writers.world} ranks, the manifest says {buckets!r} buckets "
                              f"and world size {m.get('world_size')!r} (corrupt manifest)")
    if buckets != owners.buckets:
        raise CheckpointError(
            f"{where}: the model was saved with {buckets} buckets, this run routes keys "
            f"by {owners.buckets}; a model keeps its bucket count for life: restore with "
            f"owners=kvcoll.routing.OwnerMap.even(world, buckets={buckets})")
    return writers


def _writer_rank(info: dict, writers: OwnerMap, m: dict, fname: str) -> int:
    """The rank of the writer of file `fname` of version-3 checkpoint m, checked."""
    rank, world = info.get("rank"), info.get("world")
    if world != writers.world or not isinstance(rank, int) or not 0 <= rank < world:
        raise CheckpointError(f"{os.path.join(m['_name'], MANIFEST)}: {fname} was written "
                              f"by rank {rank!r} of {world!r}, not a rank of its owner map's "
                              f"{writers.world} (corrupt manifest)")
    return rank


def _check_admission(path: str, records: list, t: KvTable) -> dict:
    """An admission state file's records by name, checked against table t: what
    import_admission takes without an error (it runs after the rows were replayed)."""
    if len(records) != len(ADMISSION_ARRAYS):
        raise CheckpointError(f"checkpoint file {path}: {len(records)} arrays, expected "
                              f"{len(ADMISSION_ARRAYS)} ({', '.join(ADMISSION_ARRAYS)}): not "
                              "an admission state file")
    recs = dict(zip(ADMISSION_ARRAYS, records))
    n = recs["keys"].shape[0] if recs["keys"].ndim == 1 else -1
    want = {"keys": ((n,), np.int64), "counts": ((n,), np.uint32),
            "steps": ((n,), np.uint32), "bloom": (recs["bloom"].shape[:1], np.uint8),
            "bloom_adds": ((1,), np.int64)}
    for name, (shape, dtype) in want.items():
        if recs[name].shape != shape or recs[name].dtype != dtype:
            raise CheckpointError(
                f"checkpoint file {path}: {name} is {recs[name].dtype} {recs[name].shape}, "
                f"expected {np.dtype(dtype)} {shape}: the file is corrupt, restore an "
                "earlier checkpoint")
    counters, nbytes = t.bloom_counters_bytes
    adds = int(recs["bloom_adds"][0])
    problem = None
    if n and (counters or t.admit_min_count < 2):
        problem = f"{n} pending keys, but table {t.name!r} counts no sightings exactly"
    elif n and not recs["counts"].all():
        problem = "a pending key with a count of 0"
    elif recs["bloom"].size and recs["bloom"].size != nbytes:
        problem = (f"a Bloom filter of {recs['bloom'].size} bytes, table {t.name!r} has "
                   f"{nbytes}")
    elif recs["bloom"].size and not 0 <= adds <= counters:
        problem = f"{adds} Bloom filter additions, the filter has {counters} counters"
    if problem:
        raise CheckpointError(f"checkpoint file {path}: the admission state holds {problem}; "
                              "it was saved with other admission settings (restore with "
                              "the table's admit, admit_min_count and bloom_counters of the "
                              "run that saved it) or the file is corrupt")
    return recs


def _nibbles(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed & 15, packed >> 4], axis=1)


def _pack_nibbles(n: np.ndarray) -> np.ndarray:
    return (n[:, 0] | (n[:, 1] << 4)).astype(np.uint8)


def _rows_to_save(t: KvTable, delta: bool) -> dict:
    """The rows a save writes, clearing their dirty bits: the dirty ones for a delta,
    every row otherwise (a full save reads them in one C call into arrays sized once,
    not in batches joined by a copy)."""
    if delta:
        return t.export(dirty_only=True, clear_dirty=True)
    (rows,) = t.export_batches(clear_dirty=True, batch=len(t) + 1,
                               columns=("slots", "last_step", "counts"))
    return rows


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


# -- the checkpointer ----------------------------------------------------------------------

class Checkpointer:
    """Saves and restores a fixed set of tables (and optionally a dense part) on a
    communicator. Keeps the incremental chain: the checkpoint the tables' dirty bits
    are relative to. kv.save / kv.restore keep one per Trainer; use this class
    directly for tables without a Keras model (bench, engine-only scripts).

    owners: the kvcoll.routing.OwnerMap the tables are sharded by (default: the even
    map of comm.size, the exchanges' default): a save records it and groups each file
    by its buckets; a restore gives each rank the keys it owns under it.
    restore_buffer: the bytes a restore may use beyond the tables (default 256 MiB).
    version: the format it writes (3, or 1 for a kvcoll that reads only version 1;
    version 2 is read, no longer written)."""

    def __init__(self, tables: dict, comm, dense=None, *, owners: OwnerMap | None = None,
                 restore_buffer: int = RESTORE_BUFFER, version: int = VERSION):
        if version not in (1, VERSION):
            raise InvalidArgumentError(f"checkpoint format version must be {VERSION} or 1 "
                                       f"(format 2 is read but no longer written), got "
                                       f"{version!r}")
        self.tables = dict(tables)
        self.comm = comm
        self.dense = dense
        self.owners = owners_for(comm, owners)
        self.restore_buffer = _checked_buffer(restore_buffer)
        self.version = version
        self._parent = None  # (abs dir, name, version) the dirty bits are relative to
        self.chain_dir = None  # the directory of the last save or restore (its chain)
        self._carried: dict = {}  # per table: removed keys a refill kept for the next save

    # -- save ------------------------------------------------------------------------

    def save(self, directory, step: int, *, incremental: bool = False,
             progress: dict | None = None) -> SaveInfo:
        """Write a checkpoint of the tables (and the dense part) at `step`. A collective.
        progress: this rank's JSON-able progress as of that step (where its data stood:
        the epoch, the step in it, its reader's position), recorded per rank in the
        manifest (format 4) and handed back by restore (RestoreInfo.progress)."""
        t0 = time.perf_counter()
        comm = self.comm
        directory = os.path.abspath(os.fspath(directory))
        plan = self._plan(directory, int(step), incremental) if comm.rank == 0 else None
        # From the plan's broadcast on, the dirty bits may be cleared (on the ranks that
        # got it: a lost peer can end it on some ranks only): until this save commits,
        # the next one must be full, on every rank alike.
        parent, self._parent = self._parent, None
        plan = json.loads(comm.bcast_bytes(
            json.dumps(plan).encode() if comm.rank == 0 else None, op="checkpoint:plan"))
        if "error" in plan:
            self._parent = parent       # (every rank got the same plan: nothing cleared)
            raise CheckpointError(plan["error"])
        tmp = os.path.join(directory, plan["tmp"])
        delta = plan["kind"] == "delta"
        files, err = {}, None
        try:
            for i, (name, t) in enumerate(self.tables.items()):
                t.track_removed(True)  # from now on removals are logged for the next delta
                logged = t.take_removed()  # a full save holds every live row: drop it
                carried = self._carried.pop(name, None)   # (taken out by a refill)
                if carried is not None:
                    logged = np.concatenate([carried, logged])
                removed = np.unique(logged) if delta else np.zeros(0, np.int64)
                # format 1: as kvcoll wrote it, a baseline for the benchmark
                rows = t.export(dirty_only=delta, clear_dirty=True) if self.version == 1 \
                    else _rows_to_save(t, delta)
                fname = f"{i:03d}-{_safe(name)}.r{comm.rank}-of-{comm.size}.kvs"
                path = os.path.join(tmp, fname)
                if self.version == 1:
                    _check_finite(name, rows, comm.rank)
                    sha, nbytes = _shards.write_shard_v1(
                        path, [rows["keys"], rows["values"], rows["slots"],
                               rows["last_step"], rows["counts"], removed])
                    info = {"sha256": sha, "bytes": nbytes, "rows": int(rows["keys"].size)}
                else:
                    # a key whose bucket went to another rank is no longer ours to remove
                    removed = removed[self.owners.owner_of(removed) == comm.rank]
                    _check_owned(name, rows["keys"], self.owners, comm.rank)
                    _check_finite(name, rows, comm.rank)
                    info = _write_shard(path, rows, removed, self.owners.buckets)
                files[fname] = {**info, "table": name, "rank": comm.rank, "world": comm.size}
                del rows
                if self.version >= 2 and t.admit_min_count >= 2:
                    files.update(_write_admission(tmp, fname, t, name, comm))
            if comm.rank == 0 and self.dense is not None:
                for fname in self.dense.write(tmp):
                    path = os.path.join(tmp, fname)
                    with open(path, "rb+") as f:
                        os.fsync(f.fileno())
                    sha, nbytes = _shards.sha256_file(path)
                    files[fname] = {"sha256": sha, "bytes": nbytes, "table": None}
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"rank {comm.rank}: saving {tmp} failed: {type(exc).__name__}: {exc}"
        gathered = comm.allgather_json({"files": files, "error": err, "map": self._map_id(),
                                        "progress": progress}, "checkpoint:files")
        errors = [g["error"] for g in gathered if g["error"]]
        if len({g["map"] for g in gathered}) > 1:
            errors.append(f"the ranks route by different owner maps "
                          f"({[g['map'] for g in gathered]}, by rank): every rank must "
                          "pass the same owners= (nothing was saved)")
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
        # Elastic: the save counts only if every rank got here. No collective may follow
        # this vote: a peer lost after it would end the save on some ranks and not on
        # others, and they would part ways (one saving again, one going on). A no (a peer
        # lost before it) makes the survivors save again; what rank 0 committed is a
        # whole checkpoint all the same (every rank's files were durable).
        gate = getattr(comm, "gate", None)
        if gate is not None:
            gate()
        self._parent = (directory, plan["name"], self.version)
        self.chain_dir = directory
        return SaveInfo(os.path.join(directory, plan["name"]), plan["name"], plan["kind"],
                        int(step), result["rows"], result["bytes"], time.perf_counter() - t0)

    def _map_id(self) -> str:
        """A short digest of the owner map, to check every rank routes by the same."""
        return hashlib.sha256(self.owners.array.tobytes()).hexdigest()[:16] + \
            f"/{self.owners.world}"

    def _plan(self, directory: str, step: int, incremental: bool) -> dict:
        """Rank 0: the kind, the final and the temporary name; creates the tmp dir."""
        try:
            os.makedirs(directory, exist_ok=True)
            for entry in os.listdir(directory):  # saves a crash abandoned
                if entry.startswith("ckpt-") and ".tmp-" in entry:
                    shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            parent = None
            if incremental and self._parent is not None and self._parent[0] == directory \
                    and self._parent[2] == self.version \
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
                                                if v["table"] == name and not v.get("admission")),
                                "rows": sum(v["rows"] for v in files.values()
                                            if v["table"] == name)}
                adm = sorted(f for f, v in files.items() if v["table"] == name
                             and v.get("admission"))
                if adm:
                    tables[name]["admission"] = adm
            keep = ("sha256", "bytes", "rank", "world") if self.version == 1 else \
                ("sha256", "bytes", "rank", "world", "rows", "removed", "pages", "index")
            manifest = {
                "format": FORMAT, "version": self.version, "kind": plan["kind"],
                "parent": plan["parent"], "step": int(step), "world_size": self.comm.size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "checksum": "sha256", "id_hash": ids.id_hash(), "tables": tables,
                "dense": sorted(f for f, v in files.items() if v["table"] is None) or None,
                "files": {f: {k: v[k] for k in keep if k in v}
                          for f, v in sorted(files.items())},
            }
            if self.version >= 4:
                manifest["progress"] = [g["progress"] for g in gathered]
            if self.version >= 3:
                manifest["page_bytes"] = _shards.PAGE_BYTES
                manifest["buckets"] = self.owners.buckets
                manifest["owners"] = self.owners.to_json()
            _shards.write_durably(os.path.join(tmp, MANIFEST),
                         (json.dumps(manifest, indent=1) + "\n").encode())
            _shards.fsync_dir(tmp)
            final = os.path.join(directory, plan["name"])
            os.rename(tmp, final)
            _shards.fsync_dir(directory)
            _shards.write_durably(os.path.join(directory, LATEST + ".tmp"), (plan["name"] + "\n").encode())
            os.replace(os.path.join(directory, LATEST + ".tmp"), os.path.join(directory, LATEST))
            _shards.fsync_dir(directory)
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            return {"error": f"committing the checkpoint in {directory} failed: "
                             f"{type(exc).__name__}: {exc} (the previous checkpoint is intact)"}
        return {"rows": sum(t["rows"] for t in tables.values()),
                "bytes": sum(v["bytes"] for v in files.values())}

    @property
    def parent(self) -> str | None:
        """The checkpoint the next incremental save would be a delta of (None: the next
        save is full), in `chain_dir`."""
        return self._parent[1] if self._parent is not None else None

    def replan(self, comm, owners: OwnerMap | None = None) -> None:
        """Save and restore on communicator `comm` and owner map `owners` from now on (a
        world that changed: kvcoll.elastic). The incremental chain goes on: the next
        delta holds the rows changed since the last save, under the new map."""
        self.comm = comm
        self.owners = owners_for(comm, owners)

    # -- restore ---------------------------------------------------------------------

    def _load_everywhere(self, directory, checkpoint, buffer_bytes, only, op, what):
        """Load (and verify) the checkpoint on every rank, a collective: every rank
        raises the first rank's error (naming it) if any rank cannot, before anything
        changes ("nothing was <what>")."""
        comm = self.comm
        err, loaded = None, None
        try:
            loaded = self._load(directory, checkpoint, buffer_bytes, only=only)
        except CheckpointError as exc:
            err = f"rank {comm.rank}: {exc}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            err = f"rank {comm.rank}: {directory}: unreadable checkpoint " \
                  f"({type(exc).__name__}: {exc})"
        errors = [e for e in comm.allgather_json(err, op) if e]
        if errors:
            if loaded is not None:
                loaded.close()
            raise CheckpointError(errors[0] + f"; nothing was {what}")
        return loaded

    def refill(self, directory, buckets, *, checkpoint: str | None = None,
               buffer_bytes: int | None = None) -> RestoreInfo:
        """Restore only the rows of `buckets` (a bool mask over the owner map's buckets,
        or an array of bucket numbers) that this rank owns, from `directory`'s latest
        checkpoint chain (or `checkpoint`): what a survivor does with the buckets of a
        lost rank (kvcoll.elastic). Every other row, the dense part, the removed-keys log
        and the incremental chain stay as they are; the refilled rows are clean (the
        chain holds them) and their admission state comes back too. Only the pages that
        hold such buckets are read. A collective; on any problem every rank raises
        CheckpointError before anything changed. RestoreInfo.rows: the rows this rank
        refilled."""
        t0 = time.perf_counter()
        comm = self.comm
        only = np.zeros(self.owners.buckets, bool)
        b = np.asarray(buckets)
        if b.dtype == bool:
            if b.shape != only.shape:
                raise InvalidArgumentError(f"refill: a bucket mask must have the map's "
                                           f"{only.size} entries, got shape {b.shape}")
            only[:] = b
        else:
            b = b.astype(np.int64).reshape(-1)
            if b.size and (b.min() < 0 or b.max() >= only.size):
                raise InvalidArgumentError(f"refill: buckets must be in [0, {only.size}), got "
                                           f"{int(b.min())}..{int(b.max())}")
            only[b] = True
        buffer_bytes = self.restore_buffer if buffer_bytes is None \
            else _checked_buffer(buffer_bytes)
        directory = os.path.abspath(os.fspath(directory))
        loaded = self._load_everywhere(directory, checkpoint, buffer_bytes, only,
                                       "checkpoint:refill:verify", "refilled")
        before = sum(len(t) for t in self.tables.values())
        err = None
        try:
            # the replay's deletions are no news for the next delta, this rank's own
            # removals since the last save are: they wait outside the log meanwhile
            for name, t in self.tables.items():
                mine = t.take_removed()
                if mine.size or name in self._carried:
                    self._carried[name] = np.concatenate(
                        [self._carried.get(name, np.zeros(0, np.int64)), mine])
            loaded.apply()
            for t in self.tables.values():
                t.take_removed()
            for name, state in loaded.admission.items():
                self.tables[name].import_admission(state, merge=True)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
        finally:
            loaded.close()
        errors = [e for e in comm.allgather_json(err, "checkpoint:refill:replayed") if e]
        if errors:
            raise CheckpointError(errors[0] + " (while refilling buckets from the checkpoint "
                                  "chain, after every rank had verified it)")
        chain = loaded.chain
        return RestoreInfo(os.path.join(directory, chain[-1]["_name"]), chain[-1]["_name"],
                           chain[-1]["step"], tuple(m["_name"] for m in chain),
                           sum(len(t) for t in self.tables.values()) - before, loaded.nbytes,
                           time.perf_counter() - t0)

    def restore(self, directory, checkpoint: str | None = None, *,
                buffer_bytes: int | None = None) -> RestoreInfo:
        """Replace the tables (and the dense part) with a checkpoint's state: `latest`
        unless `checkpoint` names one. A collective; on any problem every rank raises
        CheckpointError and nothing has changed. buffer_bytes (default: the
        Checkpointer's restore_buffer) bounds the memory it uses beyond the tables."""
        t0 = time.perf_counter()
        comm = self.comm
        buffer_bytes = self.restore_buffer if buffer_bytes is None \
            else _checked_buffer(buffer_bytes)
        directory = os.path.abspath(os.fspath(directory))
        loaded = self._load_everywhere(directory, checkpoint, buffer_bytes, None,
                                       "checkpoint:verify", "restored")
        # Verified everywhere: now change things, the dense model first (it can be rolled
        # back), and agree on every part, so no rank is left half-restored.
        self._parent = None
        before = self.dense.snapshot() if self.dense is not None else None
        err = None
        if self.dense is not None:
            try:
                self.dense.read(os.path.join(directory, loaded.chain[-1]["_name"]))
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                err = f"rank {comm.rank}: loading the dense model: {type(exc).__name__}: {exc}"
        errors = [e for e in comm.allgather_json(err, "checkpoint:dense") if e]
        if errors:
            loaded.close()
            self.dense.rollback(before)
            raise CheckpointError(errors[0] + "; nothing was restored (the dense model was "
                                  "rolled back)")
        err = None
        try:
            loaded.apply()
        except CheckpointError as exc:  # a file changed since pass 1 verified it
            err = f"rank {comm.rank}: {exc} (it changed during the restore)"
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
        finally:
            loaded.close()
        errors = [e for e in comm.allgather_json(err, "checkpoint:replayed") if e]
        if errors:
            for t in self.tables.values():
                t.clear()
            if self.dense is not None:
                self.dense.rollback(before)
            raise CheckpointError(
                errors[0] + "; this happened while replaying the checkpoint, after every "
                "rank had verified it: every table was cleared (the dense model was rolled "
                "back)")
        ids.adopt_id_hash(loaded.id_hash, os.path.join(directory, loaded.chain[-1]["_name"]))
        self._carried = {}
        for t in self.tables.values():
            t.track_removed(True)  # the next delta's removals are relative to this one
            t.take_removed()
        for name, state in loaded.admission.items():  # as of the last checkpoint
            self.tables[name].import_admission(state, merge=state.pop("merge"))
        chain = loaded.chain
        last = chain[-1]
        comm.barrier("checkpoint:restored")
        self._parent = (directory, last["_name"], last["version"])
        self.chain_dir = directory
        return RestoreInfo(os.path.join(directory, last["_name"]), last["_name"], last["step"],
                           tuple(m["_name"] for m in chain),
                           sum(len(t) for t in self.tables.values()), loaded.nbytes,
                           time.perf_counter() - t0, tuple(last.get("progress") or ()))

    def _load(self, directory: str, checkpoint: str | None, buffer_bytes: int, only=None):
        """Read and verify everything this rank needs (pass 1); change nothing. only: a
        bool mask of buckets (refill): their rows alone, no dense part."""
        if checkpoint is None:
            try:
                with open(os.path.join(directory, LATEST)) as f:
                    checkpoint = f.read().strip()
            except FileNotFoundError:
                raise CheckpointError(f"{directory} has no checkpoint (no '{LATEST}' file)") \
                    from None
        chain, seen = [], set()
        name = checkpoint
        while True:
            if not isinstance(name, str) or not _NAME_RE.match(name) or len(chain) > 100000:
                raise CheckpointError(f"{directory}: {name!r} is not a checkpoint name")
            if name in seen:
                raise CheckpointError(
                    f"{os.path.join(directory, chain[0]['_name'], MANIFEST)}: its parent "
                    f"{name!r} is already in the chain {[m['_name'] for m in chain]}: the "
                    "chain loops (corrupt manifest); restore an earlier checkpoint")
            m = _read_manifest(directory, name)
            seen.add(name)
            chain.insert(0, m)
            if m["kind"] == "full":
                break
            name = m["parent"]
        versions = sorted({m["version"] for m in chain})
        if len(versions) > 1:
            raise CheckpointError(
                f"{directory}: the chain {[m['_name'] for m in chain]} mixes format versions "
                f"{versions}; kvcoll never writes such a chain")
        for m in chain:
            _check_specs(m, self.tables, os.path.join(directory, m["_name"]))
        id_hash = _id_hash(directory, chain)
        last = chain[-1]
        nbytes = 0
        if self.dense is not None and only is None:
            if not last.get("dense"):
                raise CheckpointError(f"{os.path.join(directory, last['_name'])} holds no "
                                      "dense model; it was saved without one")
            for fname in last["dense"]:
                info = last["files"][fname]
                _shards.read_verified(os.path.join(directory, last["_name"], fname),
                                      info["sha256"], info["bytes"])
                nbytes += info["bytes"]
            self.dense.check(os.path.join(directory, last["_name"]))
        if versions[0] == 1:
            loaded = _V1Load(directory, chain, self.tables, self.comm, nbytes, self.owners,
                             only)
        else:
            loaded = _Replay(directory, chain, self.tables, self.comm, buffer_bytes, nbytes,
                             self.owners, only)
        loaded.admission = _read_admission(directory, last, self.tables, self.comm,
                                           self.owners, only)
        loaded.id_hash = id_hash
        return loaded


def _id_hash(directory: str, chain: list) -> str:
    """The string hash a chain's keys were made with ("id_hash"; absent: "xxh64"), checked
    against this run's: the run adopts it if it can (kvcoll.ids.id_hash_conflict), else
    CheckpointError naming the setting to use."""
    hashes = {m.get("id_hash", ids.LEGACY_ID_HASH) for m in chain}
    where = os.path.join(directory, chain[-1]["_name"])
    if len(hashes) > 1:
        raise CheckpointError(f"{where}: its chain {[m['_name'] for m in chain]} mixes id "
                              f"hashes {sorted(hashes)}; kvcoll never writes such a chain")
    saved = hashes.pop()
    err = ids.id_hash_conflict(saved, where)
    if err:
        raise CheckpointError(err)
    return saved


def _checked_buffer(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < MIN_RESTORE_BUFFER:
        raise InvalidArgumentError(
            f"restore buffer_bytes must be an integer >= {MIN_RESTORE_BUFFER} "
            f"({MIN_RESTORE_BUFFER >> 20} MiB: four of the largest pages), got {n!r}")
    return int(n)


# -- restore, formats 3 and 2: verify every page, then replay group by group -------------

_PAGE = np.dtype([("member", "<u4"), ("file", "<u4"), ("offset", "<u8"), ("length", "<u8"),
                  ("count", "<u8"), ("first", "<u4"), ("last", "<u4"), ("kind", "<u4"),
                  ("buckets", "<u4"), ("klo", "<u4"), ("khi", "<u4"), ("filter", "u1"),
                  ("sha256", "u1", (32,))], align=True)


class _TablePlan:
    """The pages of one table this rank reads: from every checkpoint of the chain
    (member), every file that can hold its keys, only the pages that can. A page keeps
    its file's bucket count (format 3: the model's; format 2: the file's), its buckets
    [first, last], whether this rank must filter its keys by owner (the page also holds
    other ranks' keys), and its run [klo, khi] of replay keys: the buckets of the
    model (format 3) or their residues modulo `nk` (format 2: the gcd of the files'
    bucket counts, the same for a key in every file)."""

    def __init__(self, name: str, table: KvTable):
        self.name, self.table = name, table
        self.paths: list[str] = []
        self.writers: list = []   # per file: (its writer's map array, rank) or None
        self.parts: list[np.ndarray] = []
        self.pages = np.zeros(0, _PAGE)
        self.nk = 0   # replay keys: 0..nk-1 (format 2: the gcd so far; 0: no file yet)
        self.cached = None  # the pages' verified bytes, if pass 1 kept them

    def add(self, member: int, path: str, index: np.ndarray, buckets: int,
            read: np.ndarray, filt: np.ndarray, writer=None) -> None:
        index, filt = index[read], filt[read]
        rec = np.zeros(index.size, _PAGE)
        rec["member"], rec["file"] = member, len(self.paths)
        rec["buckets"], rec["filter"] = buckets, filt
        for f in ("offset", "count", "first", "last", "kind", "sha256"):
            rec[f] = index[f]
        rec["length"] = _shards.page_length(index["kind"], index["count"], self.table.dim,
                                            self.table.slot_floats)
        self.paths.append(path)
        self.writers.append(writer)
        self.parts.append(rec)

    def done(self, model_buckets: int | None) -> None:
        """model_buckets: format 3's bucket count (the replay keys); None: format 2."""
        if self.parts:
            self.pages = np.concatenate(self.parts)
        self.parts = []
        if model_buckets is not None:
            self.nk = model_buckets
            self.pages["klo"], self.pages["khi"] = self.pages["first"], self.pages["last"]
        else:
            for b in np.unique(self.pages["buckets"]).tolist():
                self.nk = math.gcd(self.nk, b)
            self.nk = max(self.nk, 1)
            self.pages["klo"] = self.pages["khi"] = self.pages["first"] % self.nk


def _batches(order: np.ndarray, spans: np.ndarray, limit: int, cut=None):
    """Cut `order` (page numbers) into runs whose spans sum to at most `limit` (a page
    larger than that alone), also wherever `cut` (a group id per page) changes."""
    start, acc = 0, 0
    for k, i in enumerate(order.tolist()):
        new_group = cut is not None and k > start and cut[i] != cut[order[k - 1]]
        if k > start and (acc + spans[i] > limit or new_group):
            yield order[start:k]
            start, acc = k, 0
        acc += int(spans[i])
    if start < order.size:
        yield order[start:]


def _groups(klo: np.ndarray, khi: np.ndarray, spans: np.ndarray, nk: int, limit: int):
    """Cut the replay keys 0..nk-1 into runs ("groups") of about `limit` bytes of pages,
    a page's bytes spread evenly over its run [klo, khi]: (start of each group, group of
    each key)."""
    per = spans / (khi.astype(np.int64) - klo + 1)
    dens = np.zeros(nk + 1)
    np.add.at(dens, klo, per)
    np.add.at(dens, khi.astype(np.int64) + 1, -per)
    dens = np.cumsum(dens[:nk])
    before = np.concatenate([[0.0], np.cumsum(dens)[:-1]])
    raw = (before // limit).astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], raw[1:] != raw[:-1]]))
    group_of = np.cumsum(np.concatenate([[0], (raw[1:] != raw[:-1]).astype(np.int64)]))
    return starts, group_of


class _Replay:
    """A format-3 (or format-2) restore on this rank, under the owner map `owners`.
    Construction is pass 1 (plan and verify, no change); apply() is pass 2 (replay into
    the tables)."""

    def __init__(self, directory: str, chain: list, tables: dict, comm, buffer_bytes: int,
                 nbytes: int, owners: OwnerMap | None = None, only=None):
        self.chain, self.comm = chain, comm
        self.rank, self.world = comm.rank, comm.size
        self.owners = owners_for(comm, owners)
        self.mine = self.owners.array == self.rank        # the buckets this rank reads
        self.only = only      # refill: a bucket mask; the tables are not cleared
        if only is not None:
            self.mine = self.mine & only
        self._mine_at = np.concatenate([[0], np.cumsum(self.mine)])
        self._residues: dict = {}
        self.version = chain[0].get("version", VERSION)
        self.limit = buffer_bytes // 4
        self.reader = _shards.PageReader(self.limit)
        self.plans = []
        nbytes_index = 0
        try:
            writers = [_manifest_owners(m, self.owners) if self.version >= 3 else None
                       for m in chain]
            for name, t in tables.items():
                plan = _TablePlan(name, t)
                for member, m in enumerate(chain):
                    meets = None
                    if writers[member] is not None:  # per writer rank: owned one of ours?
                        w = writers[member]
                        meets = np.bincount(w.array[self.mine], minlength=w.world) > 0
                    for fname in m["tables"][name]["files"]:
                        info = m["files"].get(fname)
                        if info is None:
                            raise CheckpointError(f"{m['_name']}: {fname} is not in the "
                                                  "manifest")
                        path = os.path.join(directory, m["_name"], fname)
                        if meets is not None:
                            s = _writer_rank(info, writers[member], m, fname)
                            if not meets[s]:
                                continue  # its writer's buckets and ours are disjoint
                            index = _shards.read_index(path, info, t.dim, t.slot_floats,
                                                       self.owners.buckets)
                            read, filt = self._select_v3(path, index, writers[member], s)
                            b, writer = self.owners.buckets, (writers[member].array, s)
                        else:
                            b = info.get("buckets")
                            if not isinstance(b, int) or not 1 <= b <= _shards.MAX_BUCKETS_V2:
                                raise CheckpointError(
                                    f"{path}: its bucket count {b!r} in the manifest is not "
                                    f"an integer in [1, {_shards.MAX_BUCKETS_V2}] (corrupt "
                                    "manifest)")
                            if not self._v2_file_meets(info, path):
                                continue
                            index = _shards.read_index(path, info, t.dim, t.slot_floats, b,
                                                       version=2)
                            read, filt = self._select_v2(index, b)
                            writer = None  # format 2: the keys' buckets are checked
                        nbytes_index += int(info["index"]["bytes"])
                        plan.add(member, path, index, b, read, filt, writer)
                plan.done(self.owners.buckets if self.version >= 3 else None)
                self.plans.append(plan)
            self._verify()
        except BaseException:
            self.reader.close()
            raise
        self.nbytes = nbytes + nbytes_index + self.reader.bytes_read

    # -- which pages --------------------------------------------------------------------

    def _select_v3(self, path: str, index: np.ndarray, writers: OwnerMap, s: int):
        """(read, filter) per page of a format-3 file of writer rank s. A page's keys
        are in buckets s owned, from its first bucket to its last (a map that is not
        contiguous leaves other ranks' buckets in between, which the file does not
        hold): read the pages where such a bucket is one of this rank's, filter those
        where one is not."""
        first, last = index["first"].astype(np.int64), index["last"].astype(np.int64)
        owned = writers.array == s
        bad = ~owned[first] | ~owned[last]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CheckpointError(
                f"checkpoint file {path}: the page at byte {int(index['offset'][i])} holds "
                f"buckets {int(first[i])}..{int(last[i])}, which its writer, rank {s}, did "
                "not own in its checkpoint's owner map (not a shard file kvcoll wrote)")
        at = np.concatenate([[0], np.cumsum(owned)])
        both = np.concatenate([[0], np.cumsum(owned & self.mine)])
        n_both = both[last + 1] - both[first]
        return n_both > 0, n_both < at[last + 1] - at[first]

    def _residues_of(self, g: int) -> np.ndarray:
        """How many of this rank's buckets have each residue modulo g."""
        if g not in self._residues:
            self._residues[g] = np.bincount(np.flatnonzero(self.mine) % g, minlength=g)
        return self._residues[g]

    def _v2_file_meets(self, info: dict, path: str) -> bool:
        """A format-2 file of rank s of N holds keys with (mix >> 40) mod N == s: their
        model buckets are s modulo gcd(N, B)."""
        rank, world = info.get("rank"), info.get("world")
        if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or \
                not 0 <= rank < world:
            raise CheckpointError(f"{path}: the manifest says it was written by rank "
                                  f"{rank!r} of {world!r} (corrupt manifest)")
        g = math.gcd(world, self.owners.buckets)
        return bool(self._residues_of(g)[rank % g])

    def _select_v2(self, index: np.ndarray, buckets: int):
        """(read, filter) per page of a format-2 file of `buckets` buckets: a page of
        bucket b holds keys whose model buckets are b modulo gcd(buckets, B)."""
        g = math.gcd(buckets, self.owners.buckets)
        n = self._residues_of(g)[index["first"] % g]
        return n > 0, n < self.owners.buckets // g

    # -- pass 1 -------------------------------------------------------------------------

    def _spans(self, plan: _TablePlan) -> np.ndarray:
        return (plan.pages["length"].astype(np.int64) + 7) & ~7

    def _verify(self) -> None:
        """Pass 1: read every page once, in file order, checking its sha256 and that its
        keys are in its buckets. Keeps them when they all fit the buffer."""
        keep = sum(int(self._spans(p).sum()) for p in self.plans) <= self.limit
        for plan in self.plans:
            pages, spans = plan.pages, self._spans(plan)
            views = [None] * pages.size if keep else None
            order = np.lexsort((pages["offset"], pages["file"]))
            for batch in _batches(order, spans, self.limit):
                got = self.reader.read(plan.paths, pages[batch], keep=keep)
                for i, view in zip(batch.tolist(), got):
                    n = int(pages["count"][i])
                    keys = view[:8 * n].view(np.int64)
                    b = bucket_of(keys, int(pages["buckets"][i]))
                    writer = plan.writers[int(pages["file"][i])]
                    if ((b < pages["first"][i]) | (b > pages["last"][i])).any() or \
                            (writer is not None and (writer[0][b] != writer[1]).any()):
                        raise CheckpointError(
                            f"checkpoint file {plan.paths[int(pages['file'][i])]}: the page "
                            f"at byte {int(pages['offset'][i])} holds keys outside its "
                            f"buckets {int(pages['first'][i])}..{int(pages['last'][i])}, or "
                            "of buckets its writer did not own (not a shard file kvcoll "
                            "wrote)")
                    if pages["kind"][i] == _shards.ROWS:
                        cols = _shards.split_page(view, _shards.ROWS, n, plan.table.dim,
                                                  plan.table.slot_floats)
                        _shards.check_finite(
                            cols["values"], cols["slots"], plan.paths[int(pages["file"][i])],
                            f"the rows of the page at byte {int(pages['offset'][i])}")
                    if keep:
                        views[i] = view
            plan.cached = views

    # -- pass 2 -------------------------------------------------------------------------

    def apply(self) -> None:
        """Pass 2: clear each table and replay its pages group by group (see the module
        docstring), in chain order inside a group: removals, then rows."""
        for plan in self.plans:
            t = plan.table
            if self.only is None:   # (a refill adds to the rows there are)
                t.clear()
                t.track_removed(False)  # replay's deletions are not news for the next delta
            pages, spans = plan.pages, self._spans(plan)
            if not pages.size:
                continue
            klo, khi = pages["klo"].astype(np.int64), pages["khi"].astype(np.int64)
            if (pages["kind"] == _shards.REMOVED).any():
                starts, group_of = _groups(klo, khi, spans, plan.nk, self.limit)
            else:  # nothing is removed: no row lives longer than the replay needs it
                starts, group_of = np.zeros(1, np.int64), np.zeros(plan.nk, np.int64)
            ends = np.append(starts[1:], plan.nk) - 1          # each group's last key
            g0, g1 = group_of[klo], group_of[khi]               # a page meets g0..g1
            reps = g1 - g0 + 1
            page = np.repeat(np.arange(pages.size), reps)       # (page, group) pairs
            gid = np.repeat(g0, reps) + np.arange(page.size) - np.repeat(np.cumsum(reps) -
                                                                        reps, reps)
            outside = (klo[page] < starts[gid]) | (khi[page] > ends[gid])
            order = np.lexsort((pages["offset"][page], pages["file"][page],
                                pages["kind"][page], pages["member"][page], gid))
            page, gid, outside = page[order], gid[order], outside[order]
            batches = _batches(np.arange(page.size), spans[page], self.limit, gid)
            if plan.cached is not None:
                batches = ((b, [plan.cached[i] for i in page[b].tolist()]) for b in batches)
            else:  # the next batch is read (and verified) while this one is applied
                batches = self.reader.batches(plan.paths, pages[page], batches)
            try:
                for batch, views in batches:
                    for j, view in zip(batch.tolist(), views):
                        g = int(gid[j])
                        keys = (int(starts[g]), int(ends[g])) if outside[j] else None
                        self._apply_page(plan, pages[page[j]], view, keys)
            finally:
                batches.close()  # on an error: wait for the read ahead before close()
            plan.cached = None

    def _apply_page(self, plan: _TablePlan, page, view: np.ndarray, keys=None) -> None:
        """Apply one page: only this rank's keys when it holds others' (filter), and
        only those of replay keys keys[0]..keys[1] when it reaches outside its group."""
        t, kind = plan.table, int(page["kind"])
        cols = _shards.split_page(view, kind, int(page["count"]), t.dim, t.slot_floats)
        ids = cols["removed" if kind == _shards.REMOVED else "keys"]
        keep = None
        if page["filter"] and self.only is not None:
            keep = self.mine[bucket_of(ids, self.owners.buckets)]
        elif page["filter"]:
            keep = self.owners.owner_of(ids) == self.rank
        if keys is not None:
            k = bucket_of(ids, plan.nk)
            inside = (k >= keys[0]) & (k <= keys[1])
            keep = inside if keep is None else keep & inside
        if keep is not None and not keep.all():
            cols = {c: v[keep] for c, v in cols.items()}
        if kind == _shards.REMOVED:
            t.delete(cols["removed"])
        else:
            t.import_(cols["keys"], cols["values"], slots=cols["slots"],
                      last_step=cols["last_step"], counts=cols["counts"])

    def close(self) -> None:
        self.reader.close()
        for plan in self.plans:
            plan.cached = None


# -- restore, format 1: every file this rank may need, whole, in memory ---------------------

class _V1Load:
    """A version-1 restore: reads and verifies every file (their keys were routed by
    world size, not by the owner map) and keeps this rank's rows under `owners` in
    memory until apply()."""

    def __init__(self, directory: str, chain: list, tables: dict, comm, nbytes: int,
                 owners: OwnerMap | None = None, only=None):
        rank, owners = comm.rank, owners_for(comm, owners)
        self.chain, self.tables, self.per_ckpt = chain, tables, []
        self.only = only
        mine = owners.array == rank
        if only is not None:
            mine = mine & only

        def ours(keys):
            return mine[bucket_of(keys, owners.buckets)]

        for m in chain:
            rows = {}
            for name, t in tables.items():
                parts = []
                for fname in m["tables"][name]["files"]:
                    info = m["files"].get(fname)
                    if info is None:
                        raise CheckpointError(f"{m['_name']}: {fname} is not in the manifest")
                    path = os.path.join(directory, m["_name"], fname)
                    buf = _shards.read_verified(path, info["sha256"], info["bytes"])
                    nbytes += buf.size
                    a = _shards.check_records_v1(_shards.parse_records_v1(buf, path), path,
                                                 t.dim, t.slot_floats)
                    keep = ours(a["keys"])
                    a = {k: v[ours(v)] if k == "removed" else v[keep] for k, v in a.items()}
                    parts.append(a)
                if len(parts) == 1:
                    rows[name] = parts[0]
                else:
                    rows[name] = {k: np.concatenate([p[k] for p in parts]) if parts else
                                  _empty(k, t) for k in SHARD_ARRAYS}
            self.per_ckpt.append(rows)
        self.nbytes = nbytes

    def apply(self) -> None:
        for name, t in self.tables.items():
            if self.only is None:   # (a refill adds to the rows there are)
                t.clear()
                t.track_removed(False)  # replay's deletions are not news for the next delta
            for rows in self.per_ckpt:
                r = rows[name]
                if r["removed"].size:  # removals first: a re-created key stays
                    t.delete(r["removed"])
                if r["keys"].size:
                    t.import_(r["keys"], r["values"], slots=r["slots"],
                              last_step=r["last_step"], counts=r["counts"])

    def close(self) -> None:
        self.per_ckpt = []


def _empty(name: str, t: KvTable) -> np.ndarray:
    return {"keys": np.zeros(0, np.int64), "values": np.zeros((0, t.dim), np.float32),
            "slots": np.zeros((0, t.slot_floats), np.float32),
            "last_step": np.zeros(0, np.uint32), "counts": np.zeros(0, np.uint32),
            "removed": np.zeros(0, np.int64)}[name]


def _read_manifest(directory: str, name: str) -> dict:
    path = os.path.join(directory, name, MANIFEST)
    m = _shards.read_manifest(path, FORMAT, VERSION, CheckpointError, "checkpoint", "restore")
    if m.get("kind") not in ("full", "delta") or (m["kind"] == "delta" and not m.get("parent")):
        raise CheckpointError(f"{path}: kind {m.get('kind')!r} / parent {m.get('parent')!r} "
                              "are not valid")
    m["_name"] = name
    return m


def check_shared(directory, comm) -> None:
    """Check, at the start of a job, that every rank sees the same checkpoint directory
    (a collective): rank 0 writes a file with a fresh token there and every rank reads
    it back. Every rank raises CheckpointError naming the ranks (and their hosts) that
    cannot, and the fix, before any save could write rows a restore would not find."""
    directory = os.path.abspath(os.fspath(directory))
    name = ".kvcoll-shared-check"
    token = None
    if comm.rank == 0:
        token = secrets.token_hex(8)
        try:
            os.makedirs(directory, exist_ok=True)
            _shards.write_durably(os.path.join(directory, name), token.encode())
        except OSError as exc:
            token = f"error: {exc}"
    token = comm.bcast_bytes(token.encode() if comm.rank == 0 else None,
                             op="checkpoint:shared").decode()
    if token.startswith("error: "):
        raise CheckpointError(f"cannot write to the checkpoint directory {directory} on rank "
                              f"0: {token[7:]}")
    try:
        with open(os.path.join(directory, name)) as f:
            seen = f.read().strip() == token
    except OSError:
        seen = False
    said = comm.allgather_json(seen, "checkpoint:shared:seen")
    blind = [r for r, ok in enumerate(said) if not ok]
    if blind:
        hosts = getattr(comm, "hosts", None)
        where = "" if not hosts else " on host(s) " + ", ".join(
            sorted({hosts[r] for r in blind if r < len(hosts)}))
        raise CheckpointError(
            f"rank(s) {blind}{where} do not see the checkpoint directory {directory} that "
            "rank 0 writes: every rank writes its part there and reads the parts it owns "
            "on a restore (and the survivors of a lost rank read its buckets); put it on a "
            "file system every host mounts at the same path (NFS, Lustre, a shared volume)")


def latest(directory) -> str | None:
    """The name of the newest complete checkpoint in `directory`, or None."""
    try:
        with open(os.path.join(os.fspath(directory), LATEST)) as f:
            return f.read().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None
