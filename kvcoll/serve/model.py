"""The served model: the tables in kvcoll's C tables (values only: no optimizer slots,
no admission), the dense part as the published SavedModel, and the version they hold.

A request's path (`ServedModel.predict`, called on a worker thread with a merged
batch): pin the current version; per table, one C lookup of every id of the batch
(unknown ids read zeros, as in training's predict); the positions of each input's ids
in its table's rows; one call of the serving graph with the version's dense weights;
unpin. Nothing in it is a Python loop per id.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np

from .. import optimizers
from ..publish import (PublishError, apply_version, list_versions, load_base, load_version,
                       read_latest, read_manifest)
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
                 headroom: float = 1.25):
        self.directory = os.path.abspath(os.fspath(directory))
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
                self._load_from(base, latest)
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
            self._slots = [DenseSlot(os.path.join(gdir, "saved_model"))]
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

    def predict(self, batch: Batch) -> tuple[dict, int]:
        """The model's outputs (name -> numpy array) on a checked batch, and the version
        that computed them: every row and the dense weights of that one version."""
        import tensorflow as tf

        from ..keras.batch import pad_positions

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
            for t in sig.tables:
                k = np.concatenate(keys[t["name"]]) if keys[t["name"]] else \
                    np.zeros(0, np.int64)
                rows = self.tables[t["name"]].find(k)
                if ver.overlay is not None:
                    ver.overlay.restore(t["name"], k, rows)
                args[t["graph_arg"]] = tf.constant(rows)
            out = ver.dense.fn(**args)
            return {k: v.numpy() for k, v in out.items()}, ver.number
        finally:
            self._unpin(ver)

    def close(self) -> None:
        for t in self.tables.values():
            t.close()
        self.tables = {}
