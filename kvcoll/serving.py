"""Export for serving (kv.export): a SavedModel that needs TensorFlow alone, and the plain
embedding dictionary of every table.

    kv.export(export_dir, model)          # a collective; rank 0 writes

Layout of export_dir:

    saved_model/                 tf.saved_model.load(...) in a process that imports only
                                 TensorFlow: no kvcoll, no MPI, no custom op
    embeddings/<table>.ids.npy       int64 [n], sorted ascending
    embeddings/<table>.vectors.npy   float32 [n, dim]; row i is the vector of ids[i]
    embeddings/index.json            per table: dim, rows, the two file names and the
                                     default vector unknown ids get (zeros)

In the SavedModel each table is a tf.lookup.experimental.DenseHashTable (id -> row
index, restored from the variables files, so no 2 GB graph limit) plus a values
variable [n + 1, dim] whose last row is the default vector (zeros, what
Trainer.predict reads for an unknown id). The signature "serving_default" takes
every model input by name: one-hot id features as int64 [batch], multi-hot ones as
their flat int64 ids under the feature's name plus `<name>_row_splits` (int64
[batch + 1]), numeric features with their Keras shape and dtype; it returns
{"prediction": the model's output}. The serving graph is the model's own call,
traced with each kv.Embedding gathering from the values variable at the looked-up
row indices: only standard TensorFlow ops.

All rows are gathered to every rank (Comm.allgatherv) and rank 0 writes: fine for
tests and tables up to a few GB; larger ones would need a per-rank streamed
dictionary and a sharded serving table.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["export", "DICTIONARY_DIR", "SAVED_MODEL_DIR"]

SAVED_MODEL_DIR = "saved_model"
DICTIONARY_DIR = "embeddings"
# DenseHashTable reserves two keys; ids equal to them are looked up on the side.
_EMPTY_KEY = -(2**63)
_DELETED_KEY = -(2**63) + 1


def _gather_table(comm, table) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's rows of one table, sorted by id (on every rank)."""
    rows = table.export()
    keys, _ = comm.allgatherv(rows["keys"], op=f"export:{table.name}:keys")
    values, _ = comm.allgatherv(rows["values"], op=f"export:{table.name}:values")
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]


def export(directory, model, *, dictionary: bool = True) -> dict:
    """Write a model with kv.Embedding layers (or a kv.Trainer) for serving into
    `directory` (a collective; rank 0 writes, replacing what was there). In SSP/ASP every
    rank first waits until every update is applied. Returns {"path", "tables": {name:
    rows}, "seconds"}."""
    from .checkpoint import _engine

    t0 = time.perf_counter()
    eng = _engine(model)
    eng.sync()
    comm = eng.comm
    directory = os.path.abspath(os.fspath(directory))
    gathered = {name: _gather_table(comm, t) for name, t in eng.tables.items()}
    err = None
    if comm.rank == 0:
        try:
            os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(directory))
            try:
                _write_saved_model(os.path.join(tmp, SAVED_MODEL_DIR), eng, gathered)
                if dictionary:
                    _write_dictionary(os.path.join(tmp, DICTIONARY_DIR), eng, gathered)
                if os.path.isdir(directory):
                    shutil.rmtree(directory)
                os.rename(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            err = f"export to {directory} failed: {type(exc).__name__}: {exc}"
    msg = comm.bcast_bytes((err or "").encode() if comm.rank == 0 else None, op="export:done")
    if msg:
        raise InvalidArgumentError(msg.decode())
    return {"path": directory, "tables": {n: int(k.size) for n, (k, _) in gathered.items()},
            "seconds": time.perf_counter() - t0}


def _write_dictionary(path: str, eng, gathered: dict) -> None:
    os.makedirs(path)
    index = {"format": "kvcoll-embeddings", "version": 1, "tables": {}}
    for i, (name, (keys, values)) in enumerate(gathered.items()):
        stem = f"{i:03d}-{''.join(c if c.isalnum() or c in '_.-' else '_' for c in name)}"
        np.save(os.path.join(path, stem + ".ids.npy"), keys)
        np.save(os.path.join(path, stem + ".vectors.npy"), values)
        t = eng.tables[name]
        index["tables"][name] = {"dim": t.dim, "rows": int(keys.size),
                                 "ids": stem + ".ids.npy", "vectors": stem + ".vectors.npy",
                                 "default": [0.0] * t.dim}
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")


def _write_saved_model(path: str, eng, gathered: dict) -> None:
    import tensorflow as tf

    from .keras.embedding import rows_scope
    from .keras.engine import _as_input

    model, layout = eng.model, eng.layout
    module = tf.Module()
    module.dense = list(model.variables)
    lookups, values, reserved = {}, {}, {}
    for name, (keys, vecs) in gathered.items():
        n, dim = vecs.shape
        table = tf.lookup.experimental.DenseHashTable(
            tf.int64, tf.int64, default_value=n, empty_key=_EMPTY_KEY,
            deleted_key=_DELETED_KEY, initial_num_buckets=_buckets(n), name=f"ids_{name}")
        ok = (keys != _EMPTY_KEY) & (keys != _DELETED_KEY)
        pos = np.arange(n, dtype=np.int64)
        if ok.any():
            table.insert(tf.constant(keys[ok]), tf.constant(pos[ok]))
        lookups[name] = table
        # row n: the default vector of unknown ids
        values[name] = tf.Variable(np.concatenate([vecs, np.zeros((1, dim), np.float32)]),
                                   trainable=False, name=f"values_{name}")
        reserved[name] = tuple(int(pos[keys == k][0]) if (keys == k).any() else n
                               for k in (_EMPTY_KEY, _DELETED_KEY))
    module.lookups = lookups
    module.values = values

    def index_of(table: str, ids):
        ids = tf.cast(ids, tf.int64)
        empty, deleted = reserved[table]
        is_empty, is_deleted = tf.equal(ids, _EMPTY_KEY), tf.equal(ids, _DELETED_KEY)
        safe = tf.where(is_empty | is_deleted, tf.zeros_like(ids), ids)
        idx = tf.ensure_shape(module.lookups[table].lookup(safe), [None])  # rank is lost
        idx = tf.where(is_empty, tf.constant(empty, tf.int64), idx)
        return tf.where(is_deleted, tf.constant(deleted, tf.int64), idx)

    spec, arg = {}, {}
    for name in layout.names:
        arg[name] = _arg_name(name)
        feat = layout.features.get(name)
        if feat is None:
            form = layout.forms[name]
            dt = {"float": tf.float32, "bool": tf.bool}.get(form[1]) or tf.as_dtype(form[1])
            spec[arg[name]] = tf.TensorSpec([None] + form[3], dt, name=arg[name])
            continue
        spec[arg[name]] = tf.TensorSpec([None], tf.int64, name=arg[name])
        if feat.multi_hot:
            spec[arg[name] + "_row_splits"] = tf.TensorSpec([None], tf.int64,
                                                            name=arg[name] + "_row_splits")

    def serve(**feeds):
        leaves = {}
        for name in layout.names:
            feat = layout.features.get(name)
            if feat is None:
                leaves[name] = feeds[arg[name]]
                continue
            idx = index_of(feat.table, feeds[arg[name]])
            if feat.multi_hot:
                idx = tf.RaggedTensor.from_row_splits(
                    idx, feeds[arg[name] + "_row_splits"]).to_tensor(default_value=-1)
            leaves[name] = _as_input(idx, eng._input_dtypes[name])
        rows = {t: tf.convert_to_tensor(v) for t, v in module.values.items()}
        with rows_scope(rows):
            out = model(layout.rebuild(leaves), training=False)
        return {"prediction": out}

    fn = tf.function(serve, input_signature=None, autograph=False)
    concrete = fn.get_concrete_function(**spec)
    module.serve = fn
    tf.saved_model.save(module, path, signatures={"serving_default": concrete})


def _arg_name(name: str) -> str:
    """A signature argument name for input `name` (a list position or the single input
    gets input_<i> / input)."""
    if not name:
        return "input"
    return f"input_{name}" if name.isdigit() else name


def _buckets(n: int) -> int:
    """A power of two with the load factor below 0.5 (DenseHashTable's default 0.8
    would grow it on insert)."""
    b = 8
    while b < 2 * n + 2:
        b *= 2
    return b
