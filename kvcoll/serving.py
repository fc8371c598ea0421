"""Export for serving (kv.export): a SavedModel that needs TensorFlow alone, and the plain
embedding dictionary of every table, written by every rank in parts.

    kv.export(export_dir, model)          # a collective

Layout of export_dir:

    saved_model/                 tf.saved_model.load(...) in a process that imports only
                                 TensorFlow: no kvcoll, no MPI, no custom op
    embeddings/index.json        per table: dim, rows, the default vector unknown ids get
                                 (zeros), and its parts (file names, rank, rows); and
                                 "owners", the bucket -> rank map that put each id in
                                 part owners[bucket(id)] (kvcoll.routing.OwnerMap.to_json)
    embeddings/<n>-<table>.part-<r>-of-<W>.ids.npy      int64 [n_r]: the ids rank r held
    embeddings/<n>-<table>.part-<r>-of-<W>.vectors.npy  float32 [n_r, dim]; row i is the
                                                        vector of ids[i]

How it scales. Every rank writes its own part of every table, streamed from its shard a
batch at a time (no gather: a rank holds one batch beyond its tables; the ids of a part
are in the table's storage order). Then rank 0 builds the SavedModel from the parts on
the (shared) file system: per table a values variable [n + 1, dim], filled part by part,
a batch at a time, and a DenseHashTable id -> row. So rank 0 holds the serving tables
(what the one serving process holds anyway), and about as much again at its peak,
while TensorFlow copies the variables and the hash tables out to write them (measured:
1.7x the serving size at 3M rows of dim 16), never every rank's rows on every rank.
Serving is one process: kvcoll does not shard a SavedModel. A model whose serving
tables would exceed `max_serving_bytes` (default: half of rank 0's physical memory,
since rank 0 needs about twice that to build them) is refused on every rank before
anything is written, with an error naming the sizes; `saved_model=False` exports the
dictionary alone, for an external key-value store, whatever its size.

In the SavedModel each table is a tf.lookup.experimental.DenseHashTable (id -> row
index, restored from the variables files, so no 2 GB graph limit) plus a values
variable [n + 1, dim] whose last row is the default vector (zeros, what
Trainer.predict reads for an unknown id). The signature "serving_default" takes
every model input by name: one-hot id features as [batch], multi-hot ones as their
flat ids under the feature's name plus `<name>_row_splits` (int64 [batch + 1]),
numeric features with their Keras shape and dtype; it returns {"prediction": the
model's output}. Id features that were strings in training (string data, a string
keras.Input, a reader's string column, or named in `string_features`) take the raw
strings (tf.string) and the graph hashes them with the model's id hash, bit for bit
as training did: tf.fingerprint for "farmhash64", XXH64 written in standard uint64
ops for "xxh64" (models trained before farmhash64; about 30 ops plus a loop over
32-byte stripes, so long ids cost more); other id features take int64. When some are
strings, a second signature "serving_keys" takes every id feature as its int64 keys
(for a caller that hashes itself, as before). The serving graph is the model's own
call, traced with each kv.Embedding gathering from the values variable at the
looked-up row indices: only standard TensorFlow ops.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time

import numpy as np

from . import _shards, ids as _ids
from .errors import InvalidArgumentError
from .routing import OwnerMap

__all__ = ["export", "DICTIONARY_DIR", "SAVED_MODEL_DIR", "serving_bytes"]

SAVED_MODEL_DIR = "saved_model"
DICTIONARY_DIR = "embeddings"
# DenseHashTable reserves two keys; ids equal to them are looked up on the side.
_EMPTY_KEY = -(2**63)
_DELETED_KEY = -(2**63) + 1
_BATCH = 1 << 18  # rows per write (parts) and per insert (SavedModel)


def serving_bytes(rows: int, dim: int) -> int:
    """Bytes one table takes in the served SavedModel: the values variable
    [rows + 1, dim] float32 and the DenseHashTable's buckets (int64 key and row)."""
    return (rows + 1) * dim * 4 + _buckets(rows) * 16


def _default_limit() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def _stem(i: int, name: str) -> str:
    return f"{i:03d}-{''.join(c if c.isalnum() or c in '_.-' else '_' for c in name)}"


def _part_names(i: int, name: str, rank: int, world: int) -> tuple[str, str]:
    stem = f"{_stem(i, name)}.part-{rank:05d}-of-{world:05d}"
    return stem + ".ids.npy", stem + ".vectors.npy"


def _npy_header(f, dtype, shape) -> None:
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
            "shape": tuple(shape)})


def _write_part(table, ids_path: str, vec_path: str, n: int) -> None:
    """This rank's rows of `table` as two .npy files, streamed a batch at a time."""
    got = 0
    with open(ids_path, "xb") as fi, open(vec_path, "xb") as fv:
        _npy_header(fi, np.int64, (n,))
        _npy_header(fv, np.float32, (n, table.dim))
        for part in table.export_batches(batch=_BATCH, columns=()):
            got += part["keys"].size
            if got > n:
                break
            fi.write(_shards.raw_bytes(part["keys"]))
            fv.write(_shards.raw_bytes(part["values"]))
    if got != n:
        raise InvalidArgumentError(f"table {table.name!r} changed during the export "
                                   f"({n} rows, then {got}); export between steps")


def _read_npy(path: str, dtype, shape, batch: int):
    """Yield a .npy file's rows in batches (read, not mapped), after checking its
    dtype and shape."""
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if major == 1 \
            else np.lib.format.read_array_header_2_0
        got_shape, fortran, got_dtype = read(f)
        if got_dtype != np.dtype(dtype) or tuple(got_shape) != tuple(shape) or fortran:
            raise InvalidArgumentError(f"{path}: {got_dtype} {got_shape}, expected "
                                       f"{np.dtype(dtype)} {tuple(shape)}")
        width = int(np.prod(shape[1:], dtype=np.int64))
        for s in range(0, shape[0], batch):
            k = min(batch, shape[0] - s)
            arr = np.fromfile(f, dtype, k * width)
            if arr.size != k * width:
                raise InvalidArgumentError(f"{path} ended early")
            yield arr.reshape((k,) + tuple(shape[1:]))


def export(directory, model, *, dictionary: bool = True, saved_model: bool = True,
           max_serving_bytes: int | None = None, string_features=None) -> dict:
    """Write a model with kv.Embedding layers (or a kv.Trainer) for serving into
    `directory` (a collective, replacing what was there; made 0777 & ~umask, as mkdir
    makes directories): every rank writes its part of the embedding dictionary
    (`embeddings/`), rank 0 builds the SavedModel (`saved_model/`, which serves with
    TensorFlow alone) from the parts. In SSP/ASP every rank first waits until every
    update is applied. Its collectives wait up to the I/O deadline (KVCOLL_IO_TIMEOUT).

    directory: where the export goes (a shared file system with several hosts).
    saved_model=False writes the dictionary alone (for an external key-value store, at
    any size); dictionary=False drops it once the SavedModel is built.
    max_serving_bytes (default: half of rank 0's physical memory) refuses a SavedModel
    whose tables one serving process could not hold. string_features: names of id
    inputs whose serving signature takes raw strings beyond those found (inputs that
    were strings in this process's data or declared as string keras.Inputs, and
    reader columns of strings: a model restored and exported without seeing data
    needs them named).

    Returns {"path", "tables": {name: rows}, "parts", "serving_bytes", "seconds",
    "id_hash", "string_features"}. Raises InvalidArgumentError on every rank, with
    nothing written, when both outputs are off, string_features names no id input, or
    the SavedModel would exceed max_serving_bytes; and when writing failed (the
    previous export, if any, is left as it was); CommTimeoutError when a rank does not
    take part in time."""
    from .keras.saving import engine_for

    with engine_for(model).comm.deadline("io"):
        return _export(directory, model, dictionary=dictionary, saved_model=saved_model,
                       max_serving_bytes=max_serving_bytes, string_features=string_features)


def _export(directory, model, *, dictionary: bool = True, saved_model: bool = True,
            max_serving_bytes: int | None = None, string_features=None) -> dict:
    """kv.export's work, inside its I/O deadline (see export)."""
    from .keras.saving import engine_for

    if not (dictionary or saved_model):
        raise InvalidArgumentError("export: dictionary=False and saved_model=False write "
                                   "nothing; keep at least one")
    t0 = time.perf_counter()
    eng = engine_for(model)
    named = _named_strings(eng, string_features)
    eng.sync()
    comm = eng.comm
    directory = os.path.abspath(os.fspath(directory))
    names = list(eng.tables)
    mine = {"rows": [len(eng.tables[n]) for n in names], "strings": sorted(
        named | {f for f in eng.layout.features if eng.layout.forms[f][1] == "string"
                 or f in _ids.string_features()})}
    gathered = comm.allgather_json(mine, "export:rows")
    counts = [g["rows"] for g in gathered]
    strings = sorted({f for g in gathered for f in g["strings"]})
    totals = {n: sum(c[i] for c in counts) for i, n in enumerate(names)}
    sizes = {n: serving_bytes(totals[n], eng.tables[n].dim) for n in names}
    plan = None
    if comm.rank == 0:
        plan = _plan(directory, sizes, totals, saved_model, max_serving_bytes)
    plan = json.loads(comm.bcast_bytes(json.dumps(plan).encode() if comm.rank == 0 else None,
                                       op="export:plan"))
    if "error" in plan:
        raise InvalidArgumentError(plan["error"])
    tmp = plan["tmp"]
    emb = os.path.join(tmp, DICTIONARY_DIR)
    err = None
    try:
        for i, name in enumerate(names):
            ids, vecs = _part_names(i, name, comm.rank, comm.size)
            _write_part(eng.tables[name], os.path.join(emb, ids), os.path.join(emb, vecs),
                        counts[comm.rank][i])
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        err = f"rank {comm.rank}: writing its part of the dictionary into {emb} failed: " \
              f"{type(exc).__name__}: {exc}"
    errors = [e for e in comm.allgather_json(err, "export:parts") if e]
    err = None
    if comm.rank == 0:
        try:
            if errors:
                raise InvalidArgumentError(errors[0])
            parts = {name: [(os.path.join(emb, _part_names(i, name, r, comm.size)[0]),
                             os.path.join(emb, _part_names(i, name, r, comm.size)[1]),
                             counts[r][i]) for r in range(comm.size)]
                     for i, name in enumerate(names)}
            if saved_model:
                _write_saved_model(os.path.join(tmp, SAVED_MODEL_DIR), eng, parts, strings)
            if dictionary:
                _write_index(emb, eng, parts, comm.size)
            else:
                shutil.rmtree(emb)
            if os.path.isdir(directory):
                shutil.rmtree(directory)
            os.rename(tmp, directory)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            shutil.rmtree(tmp, ignore_errors=True)
            err = f"export to {directory} failed: {type(exc).__name__}: {exc}"
    msg = comm.bcast_bytes((err or "").encode() if comm.rank == 0 else None, op="export:done")
    if msg:
        raise InvalidArgumentError(msg.decode())
    return {"path": directory, "tables": totals, "parts": comm.size,
            "serving_bytes": sum(sizes.values()) if saved_model else 0,
            "seconds": time.perf_counter() - t0, "id_hash": _ids.id_hash(),
            "string_features": strings}


def _named_strings(eng, names) -> set:
    """string_features as a set of the model's id inputs (checked: the same on every
    rank, so every rank raises the same error before any collective)."""
    if names is None:
        return set()
    names = [names] if isinstance(names, str) else list(names)
    bad = [n for n in names if n not in eng.layout.features]
    if bad:
        raise InvalidArgumentError(
            f"export: string_features {bad} are not id inputs of the model; its id inputs "
            f"(inputs of kv.Embedding layers): {sorted(eng.layout.features)}")
    return set(names)


def _plan(directory: str, sizes: dict, totals: dict, saved_model: bool, limit) -> dict:
    """Rank 0: refuse a SavedModel too large to serve; create the temporary directory."""
    total = sum(sizes.values())
    if saved_model:
        default = limit is None
        limit = _default_limit() if default else int(limit)
        if total > limit:
            big = sorted(sizes, key=sizes.get, reverse=True)[:3]
            what = ", ".join(f"{n!r}: {totals[n]:,} rows = {sizes[n] / 1e9:.2f} GB"
                             for n in big)
            why = " (default: half of rank 0's memory, since rank 0 builds it)" if default \
                else ""
            return {"error": f"export to {directory}: the SavedModel's tables need "
                             f"{total / 1e9:.2f} GB in one serving process ({what}), above "
                             f"max_serving_bytes = {limit / 1e9:.2f} GB{why}; raise "
                             "max_serving_bytes, or pass saved_model=False to export the "
                             "embedding dictionary alone (for an external key-value store)"}
    try:
        parent = os.path.dirname(directory) or "."
        os.makedirs(parent, exist_ok=True)
        # mkdir, not mkdtemp: the export gets 0777 & ~umask as any directory would
        # (mkdtemp's 0700 would keep a serving process of another user out)
        tmp = os.path.join(parent, f".export-{secrets.token_hex(6)}")
        os.mkdir(tmp)
        os.mkdir(os.path.join(tmp, DICTIONARY_DIR))
    except OSError as exc:
        return {"error": f"export to {directory}: cannot create a directory next to it: {exc}"}
    return {"tmp": tmp}


def _write_index(path: str, eng, parts: dict, world: int) -> None:
    index = {"format": "kvcoll-embeddings", "version": 2, "world_size": world, "tables": {}}
    owners = getattr(getattr(eng, "ex", None), "owners", None)  # the exchange's map
    index["owners"] = (owners or OwnerMap.even(world)).to_json()
    for name, plist in parts.items():
        t = eng.tables[name]
        index["tables"][name] = {
            "dim": t.dim, "rows": int(sum(n for _, _, n in plist)), "default": [0.0] * t.dim,
            "parts": [{"rank": r, "rows": int(n), "ids": os.path.basename(ids),
                       "vectors": os.path.basename(vecs)}
                      for r, (ids, vecs, n) in enumerate(plist)]}
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")


def _write_saved_model(path: str, eng, parts: dict, strings=()) -> None:
    import tensorflow as tf

    from .keras.embedding import rows_scope
    from .keras.compute import as_input

    model, layout = eng.model, eng.layout
    module = tf.Module()
    module.dense = list(model.variables)
    lookups, values, reserved = {}, {}, {}
    for name, plist in parts.items():
        dim = eng.tables[name].dim
        n = int(sum(c for _, _, c in plist))
        table = tf.lookup.experimental.DenseHashTable(
            tf.int64, tf.int64, default_value=n, empty_key=_EMPTY_KEY,
            deleted_key=_DELETED_KEY, initial_num_buckets=_buckets(n), name=f"ids_{name}")
        # row n: the default vector of unknown ids
        var = tf.Variable(tf.zeros([n + 1, dim], tf.float32), trainable=False,
                          name=f"values_{name}")
        special = {_EMPTY_KEY: n, _DELETED_KEY: n}
        at = 0
        for ids_path, vec_path, count in plist:
            for keys, vecs in zip(_read_npy(ids_path, np.int64, (count,), _BATCH),
                                  _read_npy(vec_path, np.float32, (count, dim), _BATCH)):
                pos = np.arange(at, at + keys.size, dtype=np.int64)
                ok = (keys != _EMPTY_KEY) & (keys != _DELETED_KEY)
                for k in special:
                    hit = np.flatnonzero(keys == k)
                    if hit.size:
                        special[k] = int(pos[hit[0]])
                if ok.any():
                    table.insert(tf.constant(keys[ok]), tf.constant(pos[ok]))
                var[at:at + keys.size].assign(vecs)
                at += keys.size
        lookups[name], values[name] = table, var
        reserved[name] = (special[_EMPTY_KEY], special[_DELETED_KEY])
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

    id_hash = _ids.id_hash()
    spec, arg = {}, {}
    for name in layout.names:
        arg[name] = _arg_name(name)
        feat = layout.features.get(name)
        if feat is None:
            form = layout.forms[name]
            dt = {"float": tf.float32, "bool": tf.bool}.get(form[1]) or tf.as_dtype(form[1])
            spec[arg[name]] = tf.TensorSpec([None] + form[3], dt, name=arg[name])
            continue
        spec[arg[name]] = tf.TensorSpec([None], tf.string if name in strings else tf.int64,
                                        name=arg[name])
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
            ids = feeds[arg[name]]
            if ids.dtype == tf.string:  # raw strings: the keys training made of them
                ids = string_keys(ids, id_hash)
            idx = index_of(feat.table, ids)
            if feat.multi_hot:
                idx = tf.RaggedTensor.from_row_splits(
                    idx, feeds[arg[name] + "_row_splits"]).to_tensor(default_value=-1)
            leaves[name] = as_input(idx, eng.input_dtypes[name])
        rows = {t: tf.convert_to_tensor(v) for t, v in module.values.items()}
        with rows_scope(rows):
            out = model(layout.rebuild(leaves), training=False)
        return {"prediction": out}

    fn = tf.function(serve, input_signature=None, autograph=False)
    signatures = {"serving_default": fn.get_concrete_function(**spec)}
    if strings:
        keys = {k: tf.TensorSpec(v.shape, tf.int64, name=v.name) if v.dtype == tf.string
                else v for k, v in spec.items()}
        signatures["serving_keys"] = fn.get_concrete_function(**keys)
    module.serve = fn
    tf.saved_model.save(module, path, signatures=signatures)


# XXH64's primes (csrc/kv_ids.c), for the graph version below.
_XP1, _XP2, _XP3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_XP4, _XP5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5


def string_keys(strings, id_hash: str):
    """int64 keys of a 1-D tf.string tensor under `id_hash`, in TensorFlow ops alone:
    what kvcoll.ids.hash_strings gives for the same bytes, bit for bit."""
    import tensorflow as tf

    if id_hash == "farmhash64":
        # tf.fingerprint writes FarmHash Fingerprint64 of each string as 8 little-endian
        # bytes; bitcast reads them in the host's order (little-endian, as TF requires)
        return tf.bitcast(tf.fingerprint(strings), tf.int64)
    if id_hash == "xxh64":
        return _xxh64_graph(strings)
    raise InvalidArgumentError(f"id hash {id_hash!r} is unknown; use one of "
                               f"{', '.join(_ids.ID_HASHES)}")


def _xxh64_graph(strings):
    """XXH64 (seed 0) of each string, vectorised over the batch: the strings as
    zero-padded little-endian 64-bit words [n, max_len // 8 + 1]; the 32-byte stripes
    in a while loop up to the longest id's count (rows with fewer keep their lanes);
    then the 8-, 4- and 1-byte tails, which all lie in at most four words from the
    row's first tail word, taken by a per-row gather."""
    import tensorflow as tf

    u64 = tf.uint64

    def c(v):
        return tf.constant(v & (2**64 - 1), u64)

    def rotl(x, r):
        return tf.bitwise.bitwise_or(tf.bitwise.left_shift(x, c(r)),
                                     tf.bitwise.right_shift(x, c(64 - r)))

    def xround(acc, lane):
        return rotl(acc + lane * c(_XP2), 31) * c(_XP1)

    def merge(acc, v):
        return tf.bitwise.bitwise_xor(acc, xround(c(0), v)) * c(_XP1) + c(_XP4)

    strings = tf.reshape(strings, [-1])
    nbytes = tf.strings.length(strings)  # bytes
    longest = tf.reduce_max(tf.concat([nbytes, [0]], 0))
    width = longest // 8 + 1                          # words per row, one spare
    words = tf.bitcast(tf.io.decode_raw(strings, tf.int64, fixed_length=width * 8), u64)
    words = tf.reshape(words, [-1, width])
    length = tf.cast(nbytes, u64)
    stripes = length // c(32)
    n = tf.shape(strings)[0]

    def fill(v):
        return tf.fill([n], c(v))

    def stripe(k, v1, v2, v3, v4):
        on = tf.cast(k, u64) < stripes
        at = 4 * k
        lanes = [words[:, at + j] for j in range(4)]
        return (k + 1, *[tf.where(on, xround(v, w), v)
                         for v, w in zip((v1, v2, v3, v4), lanes)])

    most = tf.cast(tf.reduce_max(tf.concat([stripes, [c(0)]], 0)), tf.int32)
    _, v1, v2, v3, v4 = tf.while_loop(
        lambda k, *_: k < most, stripe,
        (tf.constant(0), fill(_XP1 + _XP2), fill(_XP2), fill(0), fill(-_XP1)),
        shape_invariants=(tf.TensorShape([]),) + (tf.TensorShape([None]),) * 4)
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18)
    for v in (v1, v2, v3, v4):
        h = merge(h, v)
    h = tf.where(length >= c(32), h, fill(_XP5)) + length
    rest = length - stripes * c(32)                   # 0..31 bytes after the stripes
    first = tf.cast(stripes * c(4), tf.int64)         # index of the first tail word

    def word(i):  # word first + i of each row (clipped: a row's unused words are masked)
        at = tf.minimum(first + i, tf.cast(width, tf.int64) - 1)
        return tf.gather(words, at[:, None], batch_dims=1)[:, 0]

    eights = rest // c(8)
    for j in range(3):
        mixed = rotl(tf.bitwise.bitwise_xor(h, xround(c(0), word(j))), 27) * c(_XP1) + c(_XP4)
        h = tf.where(c(j) < eights, mixed, h)
    last = word(tf.cast(eights, tf.int64))            # the word holding the last < 8 bytes
    four = (rest % c(8)) >= c(4)
    low = tf.bitwise.bitwise_and(last, c(0xFFFFFFFF))
    h = tf.where(four, rotl(tf.bitwise.bitwise_xor(h, low * c(_XP1)), 23) * c(_XP2) + c(_XP3), h)
    skip = tf.where(four, c(32), c(0))                # bits of `last` already consumed
    ones = rest % c(4)
    for i in range(3):
        byte = tf.bitwise.bitwise_and(tf.bitwise.right_shift(last, skip + c(8 * i)), c(0xFF))
        h = tf.where(c(i) < ones, rotl(tf.bitwise.bitwise_xor(h, byte * c(_XP5)), 11) * c(_XP1),
                     h)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, c(33))) * c(_XP2)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, c(29))) * c(_XP3)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, c(32)))
    return tf.bitcast(h, tf.int64)


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
