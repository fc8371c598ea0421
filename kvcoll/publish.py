"""Publishing for serving: versioned deltas of the tables (and the dense model) that
`kvcoll serve` applies while it serves. TF-free; the Keras callback is
kv.callbacks.Publish, which gives this module the dense part.

    pub = Publisher(tables, comm, dense=...)      # once
    pub.publish("pub/", step)                     # a collective, every few seconds

Each publish is one model version (1, 2, 3, ...). A version's delta holds, per table and
per rank, the rows changed (or created) since the previous version with their values,
and the keys removed since then: values only, no optimizer slots, no row headers. The
changes come from the tables' own change tracker (KvTable.track_changes /
take_changes, in C), which is apart from the checkpoints' dirty bits and removed-keys
log: a checkpoint never hides a change from the next publish, nor the reverse. A
delta's cost is proportional to the rows it holds, not to the table. Every
`base_every` versions (and at the first one, and whenever the chain cannot continue)
the version also gets a base: every row, so a server that starts later loads the
newest base and replays the deltas after it.

Layout of a publish directory:

    DIR/latest                     the newest complete version, "<n>\\n"
    DIR/delta-0000000042/          version 42 as changes from version 41
        manifest.json              format, version, kind "delta", parent 41, step,
                                   wall_time (the training step's), tables, files with
                                   sizes and sha256, dense ({"graph", "weights": file or
                                   null when unchanged}), id_hash, buckets, owners
        000-user.r1-of-2.kvs       table "user", rank 1 of 2: a checkpoint shard file
                                   (kvcoll._shards format 3, 0 slot floats): removed keys'
                                   pages, then the changed rows' pages, each with sha256
        dense.kvw                  the dense model's weights, when they changed (.npy
                                   records in the serving graph's variable order)
    DIR/base-0000000040/           version 40 whole: kind "base", no parent, every row,
                                   the dense weights always
    DIR/graph-<hex>/               the serving graph: a SavedModel of the dense part that
                                   takes each table's looked-up rows, the id inputs'
                                   positions in them and the other inputs (written once
                                   per Publisher; manifests name it)
    DIR/readers/<id>.json          leases of running servers: the oldest version each
                                   still needs (kvcoll serve refreshes them)
    DIR/*.tmp-<hex>/               a publish in progress, or one a crash left

Atomicity: every rank writes and fsyncs its files under the version's temporary
directory; the ranks agree; rank 0 writes the manifest, renames the directory into
place, fsyncs and replaces `latest` atomically. A reader never sees a half-written
version; a crash leaves the previous versions intact.

Chains. A delta names its parent (version - 1); a server applies it only on top of
its parent and refuses anything else. A Publisher's first version in a directory is a
base with no parent (a new chain: servers that followed the old one keep serving
their last version and say a restart is needed), and so is one after a failed publish,
a table clear (e.g. a restore) or an owner-map change, since the tracker cannot
express them as changes.

Retention (one rule with checkpoints: keep the newest, never delete what a kept
version's chain or a reading server needs): the newest `keep_bases` bases, every delta
after the oldest of them, and whatever a server's fresh lease (younger than
`reader_ttl` seconds) still needs; the rest is deleted after each publish.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import time

import numpy as np

from . import _shards, ids
from .errors import CheckpointError, InvalidArgumentError
from .routing import OwnerMap, owners_for
from .table import KvTable

__all__ = ["Publisher", "PublishInfo", "PublishError", "FORMAT", "VERSION", "read_latest",
           "read_manifest", "version_dir", "load_version", "load_base", "apply_version",
           "list_versions", "Lease"]

FORMAT = "kvcoll-publish"
VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
DENSE_FILE = "dense.kvw"
READERS = "readers"
_DIR_RE = re.compile(r"^(delta|base)-(\d{10})$")


class PublishError(CheckpointError):
    """A publish that failed (every rank raises it; the previous versions are intact),
    or a version a reader refuses (corrupt, or not following its parent)."""


@dataclasses.dataclass(frozen=True)
class PublishInfo:
    """What a publish wrote: the version, whether it is a delta, a base or both, the
    rows and removed keys written over all ranks (the delta's, or the base's when there
    is no delta), whether the dense weights were written, the bytes and the seconds."""

    version: int
    kinds: tuple
    step: int
    rows: int
    removed: int
    dense: bool
    bytes: int
    seconds: float


def version_dir(kind: str, version: int) -> str:
    return f"{kind}-{int(version):010d}"


def _replace(path: str, data: bytes) -> None:
    """Write `path` atomically (a temporary file, fsync, rename, fsync the directory)."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    _shards.write_durably(tmp, data)
    os.replace(tmp, path)
    _shards.fsync_dir(os.path.dirname(path) or ".")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


def read_latest(directory) -> int | None:
    """The newest complete version in a publish directory, or None."""
    try:
        with open(os.path.join(os.fspath(directory), LATEST)) as f:
            text = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None


def list_versions(directory) -> dict:
    """{"delta": sorted versions, "base": sorted versions} of the complete ones (a
    manifest in place)."""
    out = {"delta": [], "base": []}
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return out
    for e in entries:
        m = _DIR_RE.match(e)
        if m and os.path.isfile(os.path.join(directory, e, MANIFEST)):
            out[m.group(1)].append(int(m.group(2)))
    return {k: sorted(v) for k, v in out.items()}


def _rows_of(keys, values) -> dict:
    """A shard file's rows from keys and values (no slots; zero headers)."""
    n = keys.size
    return {"keys": keys, "values": values, "slots": np.zeros((n, 0), np.float32),
            "last_step": np.zeros(n, np.uint32), "counts": np.zeros(n, np.uint32)}


class Publisher:
    """Publishes a fixed set of tables (and, through `dense`, the dense model) on a
    communicator, version after version, into one directory.

    dense: an object with weights() -> list of float arrays (the serving graph's
    variables, in order), write_graph(path) (the serving SavedModel into a new
    directory) and signature() -> dict (json: what the graph takes; kvcoll serve reads
    it): kvcoll.keras.serving_graph.ServingDense; None publishes tables alone.
    base_every: a base every this many versions (K; 1: every version is a base too).
    keep_bases: bases kept (with the deltas after the oldest kept one).
    reader_ttl: seconds after which a server's lease no longer holds files back.
    owners: the owner map the tables are sharded by (default: the even map).
    """

    def __init__(self, tables: dict, comm, dense=None, *, owners: OwnerMap | None = None,
                 base_every: int = 10, keep_bases: int = 2, reader_ttl: float = 120.0):
        for name, value in (("base_every", base_every), ("keep_bases", keep_bases)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"Publisher: {name} must be an integer >= 1, "
                                           f"got {value!r}")
        if not reader_ttl > 0:
            raise InvalidArgumentError(f"Publisher: reader_ttl must be > 0 seconds, got "
                                       f"{reader_ttl!r}")
        self.tables = dict(tables)
        self.comm = comm
        self.dense = dense
        self.owners = owners_for(comm, owners)
        self.base_every, self.keep_bases = int(base_every), int(keep_bases)
        self.reader_ttl = float(reader_ttl)
        # (abs dir, last version, versions since its base) when a delta may follow
        self._chain = None
        self._graph = None   # the graph directory's name, once written
        self._dense_digest = None  # digest of the dense weights the last version holds
        self._owners_id = self._map_id()

    def _map_id(self) -> str:
        return hashlib.sha256(self.owners.array.tobytes()).hexdigest()[:16] + \
            f"/{self.owners.world}"

    def set_owners(self, owners: OwnerMap) -> None:
        """A new owner map (after the world changed): the next version is a base."""
        self.owners = owners
        self._chain = None

    # -- publish ---------------------------------------------------------------------

    def publish(self, directory, step: int, *, base: bool = False) -> PublishInfo:
        """Publish the tables' changes since the last version (and a base when due, or
        with base=True) at training step `step`. A collective: every rank calls it."""
        t0 = time.perf_counter()
        comm = self.comm
        directory = os.path.abspath(os.fspath(directory))
        plan = self._plan(directory, int(step), base) if comm.rank == 0 else None
        plan = json.loads(comm.bcast_bytes(
            json.dumps(plan).encode() if comm.rank == 0 else None, op="publish:plan"))
        if "error" in plan:
            raise PublishError(plan["error"])
        self._chain = None  # until this version commits, the next one must be a base
        version = plan["version"]
        # 1. the changes since the last version (every rank), or note they are lost
        changes, err = {}, None
        try:
            for name, t in self.tables.items():
                if plan["delta"]:
                    changes[name] = t.take_changes()
                else:  # a base only: start tracking from this state
                    t.track_changes(True)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"rank {comm.rank}: reading the changes failed: {type(exc).__name__}: {exc}"
        lost = any(c is None for c in changes.values())
        agreed = comm.allgather_json({"error": err, "lost": lost, "map": self._owners_id},
                                     "publish:changes")
        errors = [a["error"] for a in agreed if a["error"]]
        if len({a["map"] for a in agreed}) > 1:
            errors.append("the ranks publish by different owner maps: every rank must pass "
                          "the same owners= (nothing was published)")
        if errors:
            self._abandon(directory, plan)
            raise PublishError(errors[0] + " (nothing was published; the next version is "
                               "a base)")
        if plan["delta"] and any(a["lost"] for a in agreed):
            # a table was cleared (a restore) or the tracker ran out of memory: the
            # changes since the last version cannot be written, so a new chain begins
            plan.update(delta=False, base=True, parent=None)
        # 2. this rank's files
        files = {"delta": {}, "base": {}}
        err = None
        try:
            for i, (name, t) in enumerate(self.tables.items()):
                fname = f"{i:03d}-{_safe(name)}.r{comm.rank}-of-{comm.size}.kvs"
                if plan["delta"]:
                    ch = changes[name]
                    removed = np.unique(ch["removed"])
                    info = _shards.write_shard(
                        os.path.join(directory, plan["tmp"]["delta"], fname),
                        _rows_of(ch["keys"], ch["values"]), removed, self.owners.buckets)
                    files["delta"][fname] = {**info, "table": name, "rank": comm.rank,
                                             "world": comm.size}
                if plan["base"]:
                    (rows,) = t.export_batches(batch=len(t) + 1, columns=())
                    info = _shards.write_shard(
                        os.path.join(directory, plan["tmp"]["base"], fname),
                        _rows_of(rows["keys"], rows["values"]), np.zeros(0, np.int64),
                        self.owners.buckets)
                    files["base"][fname] = {**info, "table": name, "rank": comm.rank,
                                            "world": comm.size}
            changes = None
            dense = self._write_dense(directory, plan) if comm.rank == 0 else None
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"rank {comm.rank}: writing version {version} into {directory} failed: " \
                  f"{type(exc).__name__}: {exc}"
            dense = None
        gathered = comm.allgather_json({"files": files, "error": err}, "publish:files")
        errors = [g["error"] for g in gathered if g["error"]]
        result = None
        if comm.rank == 0:
            if errors:
                self._abandon(directory, plan)
            else:
                result = self._commit(directory, plan, int(step), gathered, dense)
        result = json.loads(comm.bcast_bytes(
            json.dumps(result).encode() if comm.rank == 0 else None, op="publish:commit"))
        if errors:
            raise PublishError(errors[0] + " (the previous versions are intact; the next "
                               "version is a base)")
        if "error" in result:
            raise PublishError(result["error"])
        since = 0 if plan["base"] else plan["since_base"] + 1
        self._chain = (directory, version, since)
        if comm.rank == 0 and dense is not None:
            self._dense_digest = dense["digest"]
        kinds = tuple(k for k in ("delta", "base") if plan[k])
        return PublishInfo(version, kinds, int(step), result["rows"], result["removed"],
                           bool(dense and dense.get("written")), result["bytes"],
                           time.perf_counter() - t0)

    def _plan(self, directory: str, step: int, base: bool) -> dict:
        """Rank 0: the version, what it holds, its temporary directories."""
        try:
            os.makedirs(directory, exist_ok=True)
            for entry in os.listdir(directory):  # publishes a crash left
                if ".tmp-" in entry and entry.split(".tmp-")[0].split("-")[0] in ("delta",
                                                                                  "base"):
                    shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            latest = read_latest(directory)
            version = (latest or 0) + 1
            chain = self._chain
            follows = chain is not None and chain[0] == directory and chain[1] == latest
            delta = follows
            since = chain[2] if follows else 0
            base = base or not follows or since + 1 >= self.base_every
            tmp = {}  # both: a delta whose changes turn out lost becomes a base
            for kind, on in (("delta", delta), ("base", base or delta)):
                if on:
                    tmp[kind] = f"{version_dir(kind, version)}.tmp-{secrets.token_hex(6)}"
                    os.mkdir(os.path.join(directory, tmp[kind]))
        except OSError as exc:
            return {"error": f"cannot publish into {directory}: {exc}"}
        return {"version": version, "delta": delta, "base": base, "tmp": tmp,
                "parent": latest if delta else None, "since_base": since}

    def _abandon(self, directory: str, plan: dict) -> None:
        if self.comm.rank == 0:
            for name in plan.get("tmp", {}).values():
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    def _write_dense(self, directory: str, plan: dict) -> dict | None:
        """Rank 0: the serving graph (once) and the dense weights when they changed
        (always into a base). None without a dense part."""
        if self.dense is None:
            return None
        if self._graph is None or not os.path.isdir(os.path.join(directory, self._graph)):
            name = f"graph-{secrets.token_hex(8)}"
            tmp = os.path.join(directory, f"{name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self.dense.write_graph(os.path.join(tmp, "saved_model"))
            _shards.write_durably(os.path.join(tmp, "signature.json"),
                         (json.dumps(self.dense.signature(), indent=1) + "\n").encode())
            _shards.fsync_dir(tmp)
            os.rename(tmp, os.path.join(directory, name))
            _shards.fsync_dir(directory)
            self._graph = name
        weights = [np.ascontiguousarray(w) for w in self.dense.weights()]
        h = hashlib.sha256()
        for w in weights:
            h.update(str(w.dtype).encode() + str(w.shape).encode())
            h.update(_shards.raw_bytes(w))
        digest = h.hexdigest()
        out = {"graph": self._graph, "digest": digest, "files": {}}
        changed = digest != self._dense_digest or not plan["delta"]
        for kind in ("delta", "base"):
            if plan[kind] and (kind == "base" or changed):
                sha, nbytes = _shards.write_shard_v1(
                    os.path.join(directory, plan["tmp"][kind], DENSE_FILE), weights)
                out["files"][kind] = {"sha256": sha, "bytes": nbytes}
        out["written"] = bool(out["files"].get("delta") or not plan["delta"])
        return out

    def _commit(self, directory: str, plan: dict, step: int, gathered: list,
                dense: dict | None) -> dict:
        """Rank 0, once every rank's files are durable: manifests, renames, latest,
        retention."""
        version = plan["version"]
        try:
            total = {"rows": 0, "removed": 0, "bytes": 0}
            wall = time.time()
            for kind in ("delta", "base"):
                if not plan[kind]:
                    continue
                files = {}
                for g in gathered:
                    files.update(g["files"][kind])
                tables = {}
                for name, t in self.tables.items():
                    mine = sorted(f for f, v in files.items() if v["table"] == name)
                    tables[name] = {"dim": t.dim, "files": mine,
                                    "rows": sum(files[f]["rows"] for f in mine),
                                    "removed": sum(files[f]["removed"] for f in mine)}
                keep = ("sha256", "bytes", "rows", "removed", "pages", "index", "table",
                        "rank", "world")
                manifest = {
                    "format": FORMAT, "version": VERSION, "model_version": version,
                    "kind": kind, "parent": plan["parent"] if kind == "delta" else None,
                    "step": step, "wall_time": wall,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "world_size": self.comm.size, "buckets": self.owners.buckets,
                    "owners": self.owners.to_json(), "id_hash": ids.id_hash(),
                    "checksum": "sha256", "page_bytes": _shards.PAGE_BYTES,
                    "tables": tables,
                    "files": {f: {k: v[k] for k in keep if k in v}
                              for f, v in sorted(files.items())},
                    "dense": None if dense is None else {
                        "graph": dense["graph"], "weights": DENSE_FILE
                        if kind in dense["files"] else None,
                        **({"weights_file": dense["files"][kind]}
                           if kind in dense["files"] else {})},
                }
                tmp = os.path.join(directory, plan["tmp"][kind])
                _shards.write_durably(os.path.join(tmp, MANIFEST),
                             (json.dumps(manifest, indent=1) + "\n").encode())
                _shards.fsync_dir(tmp)
                os.rename(tmp, os.path.join(directory, version_dir(kind, version)))
                if kind == "delta" or not plan["delta"]:
                    total["rows"] += sum(t["rows"] for t in tables.values())
                    total["removed"] += sum(t["removed"] for t in tables.values())
                total["bytes"] += sum(v["bytes"] for v in files.values()) + \
                    (dense["files"][kind]["bytes"] if dense and kind in dense["files"] else 0)
            for kind, name in plan["tmp"].items():
                if not plan[kind]:  # made in case, not used
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            _shards.fsync_dir(directory)
            _replace(os.path.join(directory, LATEST), f"{version}\n".encode())
        except Exception as exc:  # noqa: BLE001
            self._abandon(directory, plan)
            return {"error": f"committing version {version} in {directory} failed: "
                             f"{type(exc).__name__}: {exc} (the previous versions are "
                             "intact)"}
        try:
            self._retain(directory)
        except OSError:
            pass  # retention is tidying: the next publish tries again
        return total

    # -- retention -------------------------------------------------------------------

    def _retain(self, directory: str) -> None:
        """Delete what no kept version and no fresh lease needs (see the module docs)."""
        got = list_versions(directory)
        bases = got["base"]
        if len(bases) <= self.keep_bases:
            return
        oldest = bases[-self.keep_bases]
        needed = oldest
        leases = Lease.read_all(directory, self.reader_ttl)
        for lease in leases:
            needed = min(needed, lease["version"])
        for b in bases:
            if b < oldest and b not in {lease.get("base") for lease in leases}:
                shutil.rmtree(os.path.join(directory, version_dir("base", b)),
                              ignore_errors=True)
        for d in got["delta"]:
            if d <= needed:
                shutil.rmtree(os.path.join(directory, version_dir("delta", d)),
                              ignore_errors=True)
        # graphs no kept version names
        named = set()
        for kind, vs in list_versions(directory).items():
            for v in vs:
                try:
                    m = read_manifest(directory, kind, v)
                except PublishError:
                    continue
                if m.get("dense"):
                    named.add(m["dense"]["graph"])
        if self._graph:
            named.add(self._graph)
        for entry in os.listdir(directory):
            if entry.startswith("graph-") and not entry.endswith(".tmp") and \
                    entry not in named:
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


# -- reading (kvcoll serve) ------------------------------------------------------------------

class Lease:
    """A reader's claim on the versions it still needs: DIR/readers/<name>.json holding
    {"version": the oldest version whose successors it needs, "base": the base it is
    loading or None, "time"}; refreshed by rewriting it. Publishers keep what fresh
    leases need."""

    def __init__(self, directory, name: str | None = None):
        self.path = os.path.join(os.fspath(directory), READERS,
                                 (name or f"{os.uname().nodename}-{os.getpid()}") + ".json")

    def hold(self, version: int, base: int | None = None) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        _replace(self.path, json.dumps({"version": int(version), "base": base,
                                        "time": time.time()}).encode())

    def release(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    @staticmethod
    def read_all(directory, ttl: float) -> list:
        out = []
        folder = os.path.join(directory, READERS)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return out
        now = time.time()
        for n in names:
            path = os.path.join(folder, n)
            try:
                if not n.endswith(".json") or now - os.path.getmtime(path) > ttl:
                    continue
                with open(path) as f:
                    d = json.load(f)
                if isinstance(d.get("version"), int):
                    out.append(d)
            except (OSError, ValueError):
                continue
        return out


def read_manifest(directory, kind: str, version: int) -> dict:
    """A version's manifest, checked for its format; raises PublishError."""
    name = version_dir(kind, version)
    path = os.path.join(os.fspath(directory), name, MANIFEST)
    m = _shards.read_manifest(path, FORMAT, VERSION, PublishError, "publish", "read")
    if m.get("kind") != kind or m.get("model_version") != version or \
            (kind == "delta" and m.get("parent") != version - 1):
        raise PublishError(f"{path}: kind {m.get('kind')!r}, version "
                           f"{m.get('model_version')!r}, parent {m.get('parent')!r} do not "
                           f"name {kind} {version} (of parent {version - 1})")
    m["_dir"] = os.path.join(os.fspath(directory), name)
    return m


def _check_tables(m: dict, dims: dict | None) -> dict:
    where = m["_dir"]
    tables = m.get("tables")
    if not isinstance(tables, dict) or not tables:
        raise PublishError(f"{where}: the manifest lists no tables")
    if dims is not None and {n: t.get("dim") for n, t in tables.items()} != dims:
        raise PublishError(
            f"{where}: its tables {sorted((n, t.get('dim')) for n, t in tables.items())} "
            f"(name, dim) are not the served model's {sorted(dims.items())}: it belongs to "
            "another model; serve it from a directory of its own")
    return tables


def _pages(m: dict, dims: dict | None):
    """Yield (table, columns) of every page of version m's shard files, each verified
    (file size, the index's sha256 from the manifest, the page's sha256, finite
    values) before it is yielded; a problem raises PublishError naming the file."""
    where, buckets = m["_dir"], m.get("buckets")
    tables = _check_tables(m, dims)
    reader = _shards.PageReader(64 << 20, threads=1)
    try:
        for name, spec in tables.items():
            dim = spec["dim"]
            for fname in spec["files"]:
                info = m["files"].get(fname)
                if info is None:
                    raise PublishError(f"{where}: {fname} is not in the manifest's files")
                path = os.path.join(where, fname)
                try:
                    index = _shards.read_index(path, info, dim, 0, buckets)
                    pages = np.zeros(index.size, [("file", "<i8"), ("offset", "<u8"),
                                                  ("length", "<i8"), ("sha256", "u1", (32,))])
                    pages["offset"] = index["offset"]
                    pages["length"] = _shards.page_length(index["kind"], index["count"], dim, 0)
                    pages["sha256"] = index["sha256"]
                    for i in range(index.size):
                        (view,) = reader.read([path], pages[i:i + 1], keep=True)
                        cols = _shards.split_page(view, int(index["kind"][i]),
                                                  int(index["count"][i]), dim, 0)
                        if "values" in cols:
                            _shards.check_finite(cols["values"], cols["slots"], path,
                                                 "its rows")
                        yield name, cols
                except CheckpointError as exc:
                    raise PublishError(str(exc).replace("restore an earlier checkpoint",
                                                        "the version is refused")) from None
    finally:
        reader.close()


def _dense_of(m: dict):
    """The dense weights a version holds (verified), or None."""
    dense = m.get("dense")
    if not dense or not dense.get("weights"):
        return None
    info = dense.get("weights_file") or {}
    path = os.path.join(m["_dir"], dense["weights"])
    try:
        buf = _shards.read_verified(path, info.get("sha256"), info.get("bytes", -1))
        return [np.array(a) for a in _shards.parse_records_v1(buf, path)]
    except CheckpointError as exc:
        raise PublishError(str(exc).replace("restore an earlier checkpoint",
                                            "the version is refused")) from None


def load_version(directory, kind: str, version: int, dims: dict | None = None,
                 between=None) -> dict:
    """Read and verify everything of one version into memory, applying nothing (a
    delta's staging: its size is the delta's): {"manifest", "tables": {name: {"keys",
    "values", "removed"}}, "dense": list of arrays or None}. dims (table -> dim) are
    checked against the manifest's; between(), if given, is called after each page (a
    server paces its staging with it). Raises PublishError naming what is wrong."""
    m = read_manifest(directory, kind, version)
    parts = {n: {"keys": [], "values": [], "removed": []} for n in _check_tables(m, dims)}
    for name, cols in _pages(m, dims):
        if "removed" in cols:
            parts[name]["removed"].append(cols["removed"])
        else:
            parts[name]["keys"].append(cols["keys"])
            parts[name]["values"].append(cols["values"])
        if between is not None:
            between()
    tables = {}
    for name, p in parts.items():
        dim = m["tables"][name]["dim"]
        tables[name] = {
            "keys": np.concatenate(p["keys"]) if p["keys"] else np.zeros(0, np.int64),
            "values": np.concatenate(p["values"]) if p["values"]
            else np.zeros((0, dim), np.float32),
            "removed": np.concatenate(p["removed"]) if p["removed"] else np.zeros(0, np.int64)}
    return {"manifest": m, "tables": tables, "dense": _dense_of(m)}


def load_base(directory, version: int, tables: dict) -> dict:
    """Fill `tables` (name -> KvTable, cleared first) from base `version`, streaming
    page by page (each verified before it is written: memory beyond the tables is one
    page). Returns {"manifest", "dense"}. On an error the tables are cleared and
    PublishError raised."""
    m = read_manifest(directory, "base", version)
    dims = {n: t.dim for n, t in tables.items()}
    for t in tables.values():
        t.clear()
    try:
        dense = _dense_of(m)
        for name, cols in _pages(m, dims):
            if "keys" in cols and cols["keys"].size:
                tables[name].update(cols["keys"], cols["values"])
    except BaseException:
        for t in tables.values():
            t.clear()
        raise
    return {"manifest": m, "dense": dense}


def apply_version(tables: dict, loaded: dict) -> None:
    """Apply a loaded version to tables (name -> KvTable): a base fills them (after a
    clear), a delta removes its keys and then writes its rows (every rank's removals
    before any rank's rows, so a row that moved between ranks ends up present)."""
    base = loaded["manifest"]["kind"] == "base"
    for name, part in loaded["tables"].items():
        t: KvTable = tables[name]
        if base:
            t.clear()
        elif part["removed"].size:
            t.delete(part["removed"])
    for name, part in loaded["tables"].items():
        if part["keys"].size:
            tables[name].update(part["keys"], part["values"])
