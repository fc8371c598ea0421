"""One rank's batch, as the step needs it: ids per feature, the other inputs, labels.

A batch arrives as Keras takes it: x (a dict of named inputs, a list, or one array),
y (an array, or a list/dict for several outputs) and sample weights. `Layout` says
what the model's inputs are (which of them are ids of which table: found by
`kvcoll.keras.engine` tracing the model once); `Layout.batch` checks a batch against
it and normalises it:

    id feature   -> (flat int64 keys, row_splits or None)   one validator: kvcoll.ids
    other input  -> a numpy array (floats as float32)
    y, weights   -> flat lists of arrays, in the layout's order

Id features may be 1-D int64/int32 arrays (one id per sample), or for an Embedding
with a combiner a tf.RaggedTensor, a (values, row_splits) pair or a 2-D array; string
ids (str/bytes arrays, string tensors) are hashed to int64 keys. Anything else gets an
InvalidArgumentError naming the feature, what it got and what it takes.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import tensorflow as tf

from ..errors import InvalidArgumentError
from ..ids import as_keys

__all__ = ["Feature", "Layout", "Batch", "DataError", "unpack", "signature", "leaves_of"]


@dataclasses.dataclass(frozen=True)
class Feature:
    """A model input of ids: the table it reads, whether it is multi-hot, and the id
    that pads its rows (None: none)."""

    name: str
    table: str
    multi_hot: bool
    padding_id: int | None = None


@dataclasses.dataclass
class Batch:
    """One rank's normalised batch (n samples)."""

    ids: dict       # feature -> (flat int64 keys, row_splits int64 or None)
    dense: dict     # input -> numpy array
    y: list | None  # label arrays, flat in the layout's order
    sw: list | None  # sample weight arrays, flat (one, or one per output)
    n: int


class DataError:
    """A data element whose reading raised `exc`: the step reports it on every rank."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def unpack(data):
    """(x, y, sample_weight) of one element of a data set, as Keras reads it: a tuple of
    1 to 3 items is always (x,), (x, y) or (x, y, sample_weight); anything else is x
    alone. (A multi-hot feature is a tf.RaggedTensor, or a (values, row_splits) pair as
    the value of one feature inside x, never the top-level tuple.)"""
    if isinstance(data, tuple):
        if not 1 <= len(data) <= 3:
            raise InvalidArgumentError(
                f"a data element must be x, (x,), (x, y) or (x, y, sample_weight); got a "
                f"tuple of {len(data)} items")
        return tuple(data) + (None,) * (3 - len(data))
    return data, None, None


def _is_ragged_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(
        isinstance(v, (np.ndarray, tf.Tensor)) and len(getattr(v, "shape", ())) == 1
        for v in value) and np.issubdtype(np.dtype(_dtype(value[1])), np.integer)


def _dtype(v):
    return v.dtype.as_numpy_dtype if isinstance(v, tf.Tensor) else np.asarray(v).dtype


def leaves_of(x) -> tuple[str, dict]:
    """(kind, {name: value}) of a model input structure: a dict (its keys), a list or
    tuple (positions "0", "1", ...), or a single value (name "")."""
    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise InvalidArgumentError(f"input names must be strings, got {bad[0]!r}")
        return "dict", dict(x)
    if isinstance(x, (list, tuple)):
        return type(x).__name__, {str(i): v for i, v in enumerate(x)}
    return "single", {"": x}


def _describe(value) -> list:
    """[form, dtype kind, ndim, static tail shape] of one leaf, for the agreement."""
    if isinstance(value, tf.RaggedTensor):
        return ["ragged", _kind(value.dtype.as_numpy_dtype), 2, []]
    if _is_ragged_pair(value):
        return ["ragged", _kind(_dtype(value[0])), 2, []]
    if isinstance(value, tf.SparseTensor):
        return ["sparse", _kind(value.dtype.as_numpy_dtype), len(value.shape), []]
    if isinstance(value, tf.Tensor):
        return ["array", _kind(value.dtype.as_numpy_dtype), value.shape.rank,
                [int(d) if d is not None else None for d in value.shape[1:]]]
    arr = np.asarray(value)
    return ["array", _kind(arr.dtype), arr.ndim, list(arr.shape[1:])]


def _kind(dtype) -> str:
    dt = np.dtype(dtype) if not isinstance(dtype, type) or dtype is not object else np.dtype(object)
    if dt.kind in "USO":
        return "string"
    if dt.kind in "iu":
        return f"int{dt.itemsize * 8}" if dt.kind == "i" else f"uint{dt.itemsize * 8}"
    if dt.kind == "b":
        return "bool"
    if dt.kind == "f":
        return "float"
    return dt.name


def _ordered(kind: str, names) -> list:
    """Leaf names in the order the structure is rebuilt in: sorted keys of a dict,
    positions of a list or tuple."""
    return sorted(names, key=int) if kind in ("list", "tuple") else sorted(names)


def _structure(v) -> list | None:
    """[kind, leaf names, [[dtype kind, static tail shape] per leaf]] of labels or
    sample weights."""
    if v is None:
        return None
    kind, leaves = leaves_of(v)
    names = _ordered(kind, leaves)
    forms = [_describe(leaves[n]) for n in names]
    return [kind, names, [["int" if f[1].startswith(("int", "uint")) else "float", f[3]]
                          for f in forms]]


def signature(x, y, sw) -> str:
    """A JSON description of a batch's structure (names, forms, dtypes, ranks), equal
    on every rank whose data has the same layout."""
    kind, leaves = leaves_of(x)
    return json.dumps({"x": [kind, {k: _describe(v) for k, v in sorted(leaves.items())}],
                       "y": _structure(y), "sw": _structure(sw)}, sort_keys=True)


class Layout:
    """What a model's inputs are, and how a batch maps onto the compiled step.

    sig: a batch signature (see `signature`); features: the id inputs (name ->
    Feature), found by tracing the model; call: (kind, names) of the structure the
    model is called with, when it differs from the data's (a functional model declared
    with a list of Inputs takes a dict keyed by their names).
    """

    def __init__(self, sig: str, features: dict, call: tuple | None = None, check=True):
        self.call = call
        d = json.loads(sig)
        self.sig = sig
        self.kind, leaves = d["x"]
        self.names = _ordered(self.kind, leaves)
        self.forms = leaves
        self.features = dict(features)
        self.single = [f for f, spec in self.features.items() if not spec.multi_hot]
        self.multi = [f for f, spec in self.features.items() if spec.multi_hot]
        self.dense = [n for n in self.names if n not in self.features]
        self.y_struct, self.sw_struct = d["y"], d["sw"]
        for name in self.dense if check else ():
            form, kind = leaves[name][0], leaves[name][1]
            if form != "array" or kind == "string":
                raise InvalidArgumentError(
                    f"input {name or 'x'!r} ({form}, {kind}) does not feed a kv.Embedding; "
                    "only id inputs may be ragged or strings (call a kv.Embedding on it, or "
                    "pass numbers)")

    # -- checking and normalising a batch ------------------------------------------------

    def batch(self, x, y, sw) -> Batch:
        kind, leaves = leaves_of(x)
        unknown = sorted(set(leaves) - set(self.names))
        missing = sorted(set(self.names) - set(leaves))
        if unknown or missing or kind != self.kind:
            tables = sorted({f.table for f in self.features.values()})
            raise InvalidArgumentError(
                f"features do not match the model's inputs: unknown {unknown}, missing "
                f"{missing}; a feature must name a model input (kv.Embedding inputs of "
                f"tables {tables}: {sorted(self.features)})")
        sizes, ids, dense = {}, {}, {}
        for name in self.names:
            value = leaves[name]
            if name in self.features:
                flat, splits = self._ids(name, value)
                ids[name] = (flat, splits)
                sizes[name] = flat.size if splits is None else splits.size - 1
            else:
                arr = _numpy(value, name)
                if arr.dtype.kind not in "fiub":
                    raise InvalidArgumentError(
                        f"feature {name!r}: numeric input must be a number array, got {arr.dtype}")
                want = _NUMPY.get(self.forms[name][1]) or np.dtype(self.forms[name][1])
                if arr.dtype != want:
                    arr = arr.astype(want)
                dense[name] = arr
                sizes[name] = arr.shape[0] if arr.ndim else 1
        ys = self._flat(y, self.y_struct, "labels", sizes)
        sws = self._flat(sw, self.sw_struct, "sample_weight", sizes)
        if len(set(sizes.values())) > 1:
            raise InvalidArgumentError(
                f"features have different batch sizes: {sizes}; every feature (and the "
                "labels) needs one entry per sample")
        n = next(iter(sizes.values())) if sizes else 0
        return Batch(ids, dense, ys, sws, int(n))

    def _flat(self, v, struct, what: str, sizes: dict):
        if struct is None:
            if v is not None:
                raise InvalidArgumentError(
                    f"this batch has {what} but the first one had none; give every batch the "
                    "same structure")
            return None
        if v is None:
            raise InvalidArgumentError(f"this batch has no {what}, the first one had; give "
                                       "every batch the same structure")
        kind, leaves = leaves_of(v)
        if [kind, _ordered(kind, leaves)] != struct[:2]:
            raise InvalidArgumentError(
                f"{what}: structure {[kind, _ordered(kind, leaves)]} differs from the first "
                f"batch's {struct[:2]}")
        out = []
        for name, (dkind, _) in zip(struct[1], struct[2]):
            arr = _numpy(leaves[name], f"{what}[{name!r}]" if name else what)
            if arr.dtype.kind not in "fiub":
                raise InvalidArgumentError(f"{what}: must be numbers, got {arr.dtype}")
            want = np.int64 if dkind == "int" else np.float32
            if arr.dtype != want:
                arr = arr.astype(want)
            out.append(arr)
            sizes[f"{what}[{name}]" if name else what] = arr.shape[0] if arr.ndim else 1
        return out

    def _ids(self, name: str, value):
        """(flat int64 keys, row_splits or None) of id feature `name`."""
        multi_hot = self.features[name].multi_hot
        splits = None
        if isinstance(value, tf.RaggedTensor):
            if value.ragged_rank != 1:
                raise InvalidArgumentError(
                    f"feature {name!r}: ragged ids must have one ragged dimension, got "
                    f"ragged_rank {value.ragged_rank}")
            splits = value.row_splits.numpy().astype(np.int64)
            value = value.flat_values.numpy()
        elif isinstance(value, tf.SparseTensor):
            raise InvalidArgumentError(
                f"feature {name!r}: a tf.SparseTensor of ids is not taken; convert it with "
                "tf.RaggedTensor.from_sparse(ids) (multi-hot) or tf.sparse.to_dense")
        elif _is_ragged_pair(value):
            value, splits = value
            splits = np.asarray(splits.numpy() if isinstance(splits, tf.Tensor) else splits,
                                np.int64)
        arr = _numpy(value, name)
        if splits is None and arr.ndim == 2:
            if not multi_hot:
                raise InvalidArgumentError(
                    f"feature {name!r}: 2-D ids need an Embedding with a combiner "
                    "('sum', 'mean' or 'sqrtn')")
            splits = np.arange(arr.shape[0] + 1, dtype=np.int64) * arr.shape[1]
            arr = arr.reshape(-1)
        if arr.ndim != 1:
            raise InvalidArgumentError(f"feature {name!r}: ids must be 1-D, got shape {arr.shape}")
        flat = as_keys(arr, f"feature {name!r}: ids")
        pad = self.features[name].padding_id
        if pad is not None and splits is not None:  # padding: not an id, dropped
            keep = flat != pad
            if not keep.all():
                rows = np.repeat(np.arange(splits.size - 1), np.diff(splits))
                lengths = np.bincount(rows[keep], minlength=splits.size - 1)
                flat = np.ascontiguousarray(flat[keep])
                splits = np.zeros(splits.size, np.int64)
                np.cumsum(lengths, out=splits[1:])
        if splits is not None:
            if not multi_hot:
                raise InvalidArgumentError(
                    f"feature {name!r}: multi-hot ids need an Embedding with a combiner "
                    "('sum', 'mean' or 'sqrtn')")
            if splits.ndim != 1 or splits.size < 1 or splits[0] != 0 or splits[-1] != flat.size \
                    or (np.diff(splits) < 0).any():
                raise InvalidArgumentError(f"feature {name!r}: row_splits are not valid for "
                                           f"{flat.size} ids")
        elif multi_hot:
            splits = np.arange(flat.size + 1, dtype=np.int64)  # one id per sample
        return flat, splits

    # -- the compiled step's inputs ----------------------------------------------------------

    def rebuild(self, leaves: dict):
        """The model's input structure from {name: tensor}."""
        kind, names = self.call or (self.kind, self.names)
        if kind == "dict":
            return {n: leaves[n] for n in names}
        if kind == "single":
            return leaves[names[0]]
        seq = [leaves[n] for n in names]
        return seq if kind == "list" else tuple(seq)

    @staticmethod
    def targets_of(sig: str) -> tuple:
        """The (labels, sample weights) structures of a batch signature."""
        d = json.loads(sig)
        return d["y"], d["sw"]

    def rebuild_targets(self, flat, struct):
        """Labels or sample weights from their flat list (struct: the layout's)."""
        if struct is None or flat is None:
            return None
        kind, names = struct[0], struct[1]
        if kind == "dict":
            return dict(zip(names, flat))
        if kind == "single":
            return flat[0]
        return list(flat) if kind == "list" else tuple(flat)


_NUMPY = {"float": np.dtype(np.float32), "bool": np.dtype(bool)}


def _numpy(value, what: str) -> np.ndarray:
    """A leaf as a numpy array (tensors converted; strings stay object/bytes arrays)."""
    if isinstance(value, tf.Tensor):
        return value.numpy()
    if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
        raise InvalidArgumentError(f"{what}: a {type(value).__name__} is only taken for ids "
                                   "of an Embedding with a combiner")
    return np.asarray(value)


def pad_positions(pos: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """Positions of a ragged feature as [batch, max_len] with -1 padding."""
    lengths = np.diff(splits)
    width = int(lengths.max()) if lengths.size else 0
    out = np.full((lengths.size, max(width, 1)), -1, np.int64)
    row = np.repeat(np.arange(lengths.size), lengths)
    col = np.arange(pos.size) - np.repeat(splits[:-1], lengths)
    out[row, col] = pos
    return out
