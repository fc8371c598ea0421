"""Helpers on one rank's arrays for fit: the validation split Keras would make, and
class weights folded into sample weights (checked: a class with no weight is an error).

Arrays are numpy arrays or dicts/lists of them; ragged ids as tf.RaggedTensor or
(values, row_splits) pairs; strings as str/bytes arrays.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from ..errors import InvalidArgumentError
from .batch import leaves_of, unpack

__all__ = ["split_validation", "with_class_weight"]


def with_class_weight(element, class_weight):
    """A data element with class_weight ({class: weight}, single output) folded into
    its sample weights."""
    if not class_weight:
        return element
    x, y, sw = unpack(element)
    if y is None or isinstance(y, (dict, list, tuple)):
        raise InvalidArgumentError(
            "class_weight needs a single output's labels; for several outputs give "
            "sample_weight per output instead")
    labels = np.asarray(y)
    cls = labels.argmax(axis=-1) if labels.ndim == 2 and labels.shape[1] > 1 \
        else labels.reshape(labels.shape[0], -1)[:, 0]
    cls = np.rint(cls).astype(np.int64)
    missing = sorted(set(np.unique(cls).tolist()) - set(class_weight))
    if missing:
        raise InvalidArgumentError(f"class_weight has no weight for class(es) {missing}")
    cw = np.array([class_weight[int(c)] for c in cls], np.float32)
    sw = cw if sw is None else np.asarray(sw, np.float32) * cw
    return x, y, sw


def split_validation(x, y, sample_weight, fraction: float):
    """(train arrays, validation arrays): the last `fraction` of this rank's samples are
    held out, as Keras' validation_split does (arrays only)."""
    if not 0 < fraction < 1:
        raise InvalidArgumentError(f"validation_split must be in (0, 1), got {fraction!r}")
    if not isinstance(x, (np.ndarray, tf.Tensor, tf.RaggedTensor, dict, list, tuple)):
        raise InvalidArgumentError("validation_split needs arrays; give a dataset "
                                   "validation_data instead")
    xs = _arrays(x, "x")
    n = _length(xs)
    cut = int(math.floor(n * (1.0 - fraction)))
    parts = []
    for v, what in ((x, "x"), (y, "y"), (sample_weight, "sample_weight")):
        if v is None:
            parts.append((None, None))
            continue
        a = _arrays(v, what)
        parts.append((_take_rows(a, slice(0, cut)), _take_rows(a, slice(cut, n))))
    return tuple(p[0] for p in parts), tuple(p[1] for p in parts)


# -- arrays -----------------------------------------------------------------------------------

def _arrays(v, what: str):
    """A structure of per-sample arrays, leaves normalised for slicing: numpy arrays,
    or ("ragged", values, row_splits) for ragged leaves."""
    kind, leaves = leaves_of(v)
    out = {}
    for name, leaf in leaves.items():
        if isinstance(leaf, tf.RaggedTensor):
            out[name] = ("ragged", leaf.flat_values.numpy(),
                         leaf.row_splits.numpy().astype(np.int64))
        elif isinstance(leaf, tuple) and len(leaf) == 2:
            vals, splits = (np.asarray(a.numpy() if isinstance(a, tf.Tensor) else a)
                            for a in leaf)
            out[name] = ("ragged", vals, splits.astype(np.int64))
        elif isinstance(leaf, tf.Tensor):
            out[name] = leaf.numpy()
        else:
            arr = np.asarray(leaf)
            if arr.ndim == 0:
                raise InvalidArgumentError(
                    f"{what}{'[' + repr(name) + ']' if name else ''}: needs one entry per "
                    "sample, got a scalar")
            out[name] = arr
    return kind, out


def _length(arrays) -> int:
    _, leaves = arrays
    sizes = {name: (leaf[2].size - 1 if isinstance(leaf, tuple) else leaf.shape[0])
             for name, leaf in leaves.items()}
    if len(set(sizes.values())) > 1:
        raise InvalidArgumentError(f"inputs have different numbers of samples: {sizes}")
    return next(iter(sizes.values())) if sizes else 0


def _take_rows(arrays, idx):
    """Rows idx (a slice or an index array) of a structure made by _arrays, in the
    structure's own kind (ragged leaves as (values, row_splits) pairs)."""
    kind, leaves = arrays
    out = {}
    for name, leaf in leaves.items():
        if isinstance(leaf, tuple):
            _, vals, splits = leaf
            if isinstance(idx, slice):
                lo, hi = idx.start, idx.stop
                out[name] = (vals[splits[lo]:splits[hi]], splits[lo:hi + 1] - splits[lo])
            else:
                lens = np.diff(splits)[idx]
                starts = splits[:-1][idx]
                pos = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) \
                    + np.arange(int(lens.sum()))
                out[name] = (vals[pos], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        else:
            out[name] = leaf[idx]
    if kind == "dict":
        return out
    if kind == "single":
        return out[""]
    seq = [out[str(i)] for i in range(len(out))]
    return seq if kind == "list" else tuple(seq)
