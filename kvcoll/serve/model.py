"""The served model: the tables in kvcoll's C tables (values only: no optimizer slots,
no admission), the dense part as the published SavedModel, and the version they hold.

A request's path (`ServedModel.predict`, called on a worker thread with a merged
batch): pin the current version; per table, one C lookup of every id of the batch
(unknown ids read zeros, as in training's predict); the positions of each input's ids
in its table's rows; one call of the serving graph with the version's dense weights;
unpin. Nothing in it is a Python loop per id.

Deltas applied live, one version per request, no second copy of the tables
(`ServedModel.poll`, on a thread of its own):
1. stage: read and verify the whole delta (every page's sha256, its parent) into
   memory: a delta that fails is refused before anything changes, the reason logged
   and kept for the status, and the last good version keeps serving;
2. keep the old: an overlay, a small C table of the rows the delta will change as they
   are now (zeros for keys it creates), is attached to the version being served;
3. apply in place, in chunks of `chunk` (1024) rows (each a C call under the table's write
   lock: a request waits for one chunk at most, about a millisecond, never for
   the whole delta), removals before rows; the new dense weights go into the other of
   two copies of the serving graph;
4. switch: new requests pin the new version. A request pinned at the old one, whose
   lookups may have seen some new rows, takes every changed key's row from the
   overlay after its lookups, so it sees exactly the old version; the overlay (whose
   size is the delta's) is dropped once no request holds the old version.
A version that does not continue the served chain (a new chain's base: training was
restarted or restored) is refused the same way: restart the server to load it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np

from .. import optimizers
from ..publish import (Lease, PublishError, apply_version, list_versions, load_base,
                       load_version, read_latest, read_manifest, version_dir)
from ..table import KvTable
from .requests import Batch, Signature

__all__ = ["ServedModel", "DenseSlot"]

log = logging.getLogger("kvcoll.serve")


class DenseSlot:
    """One loaded copy of the serving graph and its variables (the dense weights of one
    version). `pins` counts the requests using it now."""

    def __init__(self, path: str):
        import tensorflow as tf

        self.path = path
        self.loaded = tf.saved_model.load(path)
        self.fn = self.loaded.signatures["serving_default"]
        self.variables = list(self.loaded.dense)
        self.pins = 0
        self.call = self._flat_call()

    def _flat_call(self):
        """How a request calls the graph (args: name -> tensor; returns name -> tensor):
        with its flat arguments (the signature's _call_flat, in its `inputs` order),
        which skips TensorFlow binding the keyword arguments to the signature on every
        call (0.08 ms of a 0.45 ms batch of 256 with 3 tables); used only when it gives
        exactly what the keyword call gives on a probe batch, else the keyword call."""
        import tensorflow as tf

        fn = self.fn

        def keywords(args):
            return fn(**args)

        try:
            specs = fn.structured_input_signature[1]
            captured = fn.captured_inputs
            order = [t.name.split(":")[0] for t in fn.inputs[:len(fn.inputs) - len(captured)]]
            if sorted(order) != sorted(specs):
                return keywords

            def flat(args):
                return fn._call_flat([args[k] for k in order], captured)

            probe = {k: tf.zeros([1 if d is None else d for d in s.shape], s.dtype)
                     for k, s in specs.items()}
            a, b = keywords(probe), flat(probe)
            if not isinstance(b, dict) or set(a) != set(b) or \
                    any(not np.array_equal(a[k].numpy(), b[k].numpy()) for k in a):
                return keywords
            return flat
        except Exception:  # noqa: BLE001 - another TensorFlow: the keyword call
            return keywords

    def assign(self, weights: list) -> None:
        if len(weights) != len(self.variables):
            raise PublishError(f"the published dense weights hold {len(weights)} arrays, the "
                               f"serving graph {self.path} has {len(self.variables)} variables")
        for v, w in zip(self.variables, weights):
            if tuple(v.shape) != tuple(w.shape):
                raise PublishError(f"a published dense weight has shape {w.shape}, the "
                                   f"serving graph's variable {v.name} {tuple(v.shape)}")
        for v, w in zip(self.variables, weights):
            v.assign(w)


class _Version:
    """What a request pins: the version number, its dense slot and (while the next
    version is being applied) the overlay that gives this version's rows back."""

    __slots__ = ("number", "step", "wall_time", "dense", "overlay", "pins")

    def __init__(self, number, step, wall_time, dense, overlay=None):
        self.number, self.step, self.wall_time = number, step, wall_time
        self.dense, self.overlay, self.pins = dense, overlay, 0


class ServedModel:
    """A publish directory's model, loaded at its latest version (newest base, then the
    deltas after it)."""

    def __init__(self, directory, *, name: str = "model", max_batch: int = 1024,
                 headroom: float = 1.25, apply_share: float = 0.2):
        if not 0 < apply_share <= 1:
            raise ValueError(f"apply_share must be in (0, 1] (the share of a core a "
                             f"delta's apply may use while requests are served), got "
                             f"{apply_share}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.apply_share = float(apply_share)
        self.name = name
        self.headroom = float(headroom)
        self._lock = threading.Lock()      # guards _current and the pin counts
        self._current: _Version | None = None
        self.refused: list = []             # (version, reason) of versions refused
        self.applied = 0
        self.graph = None
        self.sig = None
        self.tables: dict = {}
        self._max_batch = max_batch
        self.chunk = 1024
        self.lease = Lease(self.directory)
        self._old: _Version | None = None   # the previous version, until its pins drain
        self._stuck = None                  # the version refused (not retried)
        self.apply_seconds: list = []       # per applied delta: seconds from stage to switch
        self.lock_seconds_max = 0.0         # the most CPU time one C call of an apply took
        self.call_seconds_max = 0.0         # ... and wall time (with preemption, the GIL)
        self._load()

    # -- loading ----------------------------------------------------------------------

    def _load(self) -> None:
        latest = read_latest(self.directory)
        if latest is None:
            raise PublishError(f"{self.directory} holds no published version (no 'latest' "
                               "file): start training with kv.callbacks.Publish first")
        bases = [b for b in list_versions(self.directory)["base"] if b <= latest]
        errors = []
        for base in reversed(bases):  # the newest base that loads, then its deltas
            try:
                self.lease.hold(base, base=base)  # publishers keep what a loading server needs
                self._load_from(base, latest)
                self.lease.hold(self.version)
                return
            except PublishError as exc:
                errors.append(f"base {base}: {exc}")
                log.warning("kvcoll serve: %s", errors[-1])
        raise PublishError(f"{self.directory}: no base loads with its deltas up to version "
                           f"{latest}: " + ("; ".join(errors) or "there is no base"))

    def _load_from(self, base: int, latest: int) -> None:
        m = read_manifest(self.directory, "base", base)
        if not m.get("dense"):
            raise PublishError(f"{m['_dir']}: no dense model was published with it (publish "
                               "with kv.callbacks.Publish, which writes the serving graph)")
        graph = m["dense"]["graph"]
        if graph != self.graph:
            gdir = os.path.join(self.directory, graph)
            try:
                with open(os.path.join(gdir, "signature.json")) as f:
                    sig = json.load(f)
            except (OSError, ValueError) as exc:
                raise PublishError(f"{gdir}: the serving graph's signature cannot be read "
                                   f"({exc})") from None
            for t in self.tables.values():
                t.close()
            rows = sum(int(spec["rows"]) for spec in m["tables"].values())
            self.tables = {t["name"]: KvTable(
                t["dim"], name=t["name"], optimizer=optimizers.SGD(0.01),
                initial_capacity=int(self.headroom * m["tables"][t["name"]]["rows"]))
                for t in sig["tables"]}
            log.info("kvcoll serve: loading base %d (%d rows) and the serving graph %s",
                     base, rows, graph)
            self.sig = Signature(sig, self._max_batch)
            self.graph = graph
            # two copies: a delta's dense weights go to the one no request holds (the
            # second loaded now, not at the first delta: a load's objects and time)
            self._slots = [DenseSlot(os.path.join(gdir, "saved_model")) for _ in range(2)]
        got = load_base(self.directory, base, self.tables)
        dense = got["dense"]
        number, step, wall = base, m["step"], m["wall_time"]
        for v in range(base + 1, latest + 1):
            loaded = load_version(self.directory, "delta", v, self.dims)
            apply_version(self.tables, loaded)
            if loaded["dense"] is not None:
                dense = loaded["dense"]
            mv = loaded["manifest"]
            number, step, wall = v, mv["step"], mv["wall_time"]
        slot = self._slots[0]
        slot.assign(dense)
        self._current = _Version(number, step, wall, slot)
        self._dense_weights = dense
        log.info("kvcoll serve: serving version %d (step %d)", number, step)

    @property
    def dims(self) -> dict:
        return {n: t.dim for n, t in self.tables.items()}

    # -- what it serves ------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._current.number

    def status(self) -> dict:
        cur = self._current
        return {"version": cur.number, "step": cur.step, "wall_time": cur.wall_time,
                "freshness_s": max(0.0, time.time() - cur.wall_time),
                "rows": {n: len(t) for n, t in self.tables.items()},
                "applied": self.applied,
                "apply_seconds_last": self.apply_seconds[-1] if self.apply_seconds else None,
                "apply_lock_ms_max": 1000.0 * self.lock_seconds_max,
                "apply_call_ms_max": 1000.0 * self.call_seconds_max,
                "refused": [{"version": v, "reason": r} for v, r in self.refused[-5:]]}

    def _pin(self) -> _Version:
        with self._lock:
            cur = self._current
            cur.pins += 1
            cur.dense.pins += 1
            return cur

    def _unpin(self, ver: _Version) -> None:
        with self._lock:
            ver.pins -= 1
            ver.dense.pins -= 1

    # -- live deltas -------------------------------------------------------------------

    def poll(self) -> dict:
        """Apply every version published since the one served, in order (on the
        applier's thread): the newest paced (apply_share), those before it at full
        speed, so a server that fell behind catches up whenever an unpaced one would.
        Returns {"applied": n, "refused": [(version, reason)]}."""
        out = {"applied": 0, "refused": []}
        self._drop_old()
        latest = read_latest(self.directory)
        while latest is not None and latest > self.version and self._stuck is None:
            v = self.version + 1
            try:
                self._apply(v, paced=v == latest)
                out["applied"] += 1
            except PublishError as exc:
                reason = str(exc)
                self._stuck = v
                self.refused.append((v, reason))
                out["refused"].append((v, reason))
                log.error("kvcoll serve: version %d refused: %s; still serving version %d",
                          v, reason, self.version)
        self.lease.hold(self.version)  # (refreshed at every poll)
        return out

    def _drop_old(self, wait: float = 0.0) -> bool:
        """Forget the previous version once no request holds it (waiting up to `wait`
        seconds). True when there is none left."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                old = self._old
                if old is None or old.pins == 0:
                    if old is not None and old.overlay is not None:
                        old.overlay.close()
                        old.overlay = None
                    self._old = None
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)

    def _apply(self, v: int, paced: bool = True) -> None:
        d = self.directory
        if not os.path.isfile(os.path.join(d, version_dir("delta", v), "manifest.json")):
            if os.path.isfile(os.path.join(d, version_dir("base", v), "manifest.json")):
                raise PublishError(
                    f"version {v} begins a new chain (a base without a delta from version "
                    f"{v - 1}: training was restarted or restored): restart this server to "
                    f"load base {v}")
            raise PublishError(f"delta {v} is missing from {d} (deleted by retention while "
                               "this server fell behind?): restart this server to load the "
                               "newest base")
        t0 = time.perf_counter()
        pace = _Pacer(self.apply_share if paced else 1.0)
        staged = load_version(d, "delta", v, self.dims, between=pace)  # 1. stage (verified)
        m = staged["manifest"]
        graph = (m.get("dense") or {}).get("graph")
        if graph != self.graph:
            raise PublishError(f"delta {v} names the serving graph {graph!r}, this server "
                               f"runs {self.graph!r}: restart it to load the new graph")
        if not self._drop_old(wait=30.0):
            raise PublishError(f"requests held version {self._old.number} for 30 s; delta "
                               f"{v} was not applied")
        cur = self._current
        dense = cur.dense
        if staged["dense"] is not None:                              # the other graph copy
            spare = next(s for s in self._slots if s is not cur.dense)
            spare.assign(staged["dense"])  # no request holds it: _drop_old waited
            dense = spare
        pace()
        overlay = _Overlay(self.tables, staged)                      # 2. keep the old
        with self._lock:
            cur.overlay = overlay
        longest = wall = 0.0
        for phase in ("removed", "keys"):                            # 3. in place
            for name, part in staged["tables"].items():
                t = self.tables[name]
                arr = part[phase]
                for s in range(0, arr.size, self.chunk):
                    pace()
                    c0, w0 = time.thread_time(), time.perf_counter()
                    if phase == "removed":
                        t.delete(arr[s:s + self.chunk])
                    else:
                        t.update(arr[s:s + self.chunk], part["values"][s:s + self.chunk])
                    longest = max(longest, time.thread_time() - c0)
                    wall = max(wall, time.perf_counter() - w0)
        new = _Version(v, m["step"], m["wall_time"], dense)
        with self._lock:                                             # 4. switch
            self._old, self._current = cur, new
        self.applied += 1
        self.apply_seconds.append(time.perf_counter() - t0)
        self.lock_seconds_max = max(self.lock_seconds_max, longest)
        self.call_seconds_max = max(self.call_seconds_max, wall)
        self._drop_old()

    def predict(self, batch: Batch, spent: dict | None = None) -> tuple[dict, int]:
        """The model's outputs (name -> numpy array) on a checked batch, and the version
        that computed them: every row and the dense weights of that one version. spent:
        a dict to receive the seconds of its "lookup" (the ids' rows, the overlay's
        included) and "graph" (the serving graph) parts."""
        import tensorflow as tf

        from ..keras.batch import pad_positions

        t0 = time.perf_counter()
        ver = self._pin()
        try:
            sig = self.sig
            keys = {t["name"]: [] for t in sig.tables}
            at = {t["name"]: 0 for t in sig.tables}
            args = {}
            for name, e in sig.inputs.items():
                flat, splits = batch.ids[name] if e["kind"] == "ids" else (None, None)
                if e["kind"] != "ids":
                    args[e["graph_arg"]] = tf.constant(batch.numeric[name])
                    continue
                table = sig.tables[e["table_index"]]["name"]
                pos = np.arange(at[table], at[table] + flat.size, dtype=np.int64)
                keys[table].append(flat)
                at[table] += flat.size
                args[e["graph_arg"]] = tf.constant(
                    pad_positions(pos, splits) if e["multi_hot"] else pos)
            looked = {}
            for t in sig.tables:
                k = np.concatenate(keys[t["name"]]) if keys[t["name"]] else \
                    np.zeros(0, np.int64)
                looked[t["name"]] = (k, self.tables[t["name"]].find(k))
            overlay = ver.overlay  # read after every lookup: see the module docstring
            for t in sig.tables:
                k, rows = looked[t["name"]]
                if overlay is not None:
                    overlay.restore(t["name"], k, rows)
                args[t["graph_arg"]] = tf.constant(rows)
            t1 = time.perf_counter()
            out = ver.dense.call(args)
            out = {k: v.numpy() for k, v in out.items()}
            if spent is not None:
                spent["lookup"], spent["graph"] = t1 - t0, time.perf_counter() - t1
            return out, ver.number
        finally:
            self._unpin(ver)

    def close(self) -> None:
        self.lease.release()
        for t in self.tables.values():
            t.close()
        self.tables = {}


class _Pacer:
    """Called between the pieces of an apply (a page staged, the overlay, a chunk of
    rows written): sleeps so that the apply's work is at most `share` of its time. An
    apply's CPU in one burst delays every request that arrives meanwhile (on a machine
    whose cores serve requests, the 1% that do set the p99); spread out, each request
    meets a piece of it at most. A piece is timed on the wall clock, so a busy machine,
    where a piece takes longer, gets longer pauses."""

    def __init__(self, share: float):
        self.factor = 1.0 / share - 1.0
        self.mark = time.perf_counter()

    def __call__(self) -> None:
        if self.factor > 0:
            time.sleep((time.perf_counter() - self.mark) * self.factor)
        self.mark = time.perf_counter()


class _Overlay:
    """The rows a delta changes, as they were before it (zeros for keys it creates),
    per table: the keys sorted and their rows, what a request pinned at the old version
    reads for those keys while the delta is applied. (Plain arrays, one C lookup to
    fill: a C table of its own cost as much as the rest of an apply together.)"""

    def __init__(self, tables: dict, staged: dict):
        self.parts = {}
        for name, part in staged["tables"].items():
            keys = np.sort(np.concatenate([part["removed"], part["keys"]]))
            if keys.size:   # (sorted, then deduplicated: np.unique took 30x a sort)
                keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
                self.parts[name] = (keys, tables[name].find(keys))

    def restore(self, name: str, keys: np.ndarray, rows: np.ndarray) -> None:
        part = self.parts.get(name)
        if part is None or not keys.size:
            return
        old_keys, before = part
        at = np.minimum(np.searchsorted(old_keys, keys), old_keys.size - 1)
        hit = old_keys[at] == keys
        if hit.any():
            rows[hit] = before[at[hit]]

    def close(self) -> None:
        self.parts = {}
