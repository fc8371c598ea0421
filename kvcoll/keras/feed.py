"""What fit, evaluate and predict are fed: every rank's data agreed on before a pass
(each rank's number of batches; a Python source of batches read by kvcoll's step
functions, with a stand-in for Keras to iterate; data of unknown length when the ranks'
counts differ), and helpers on one rank's arrays: the validation split Keras would make,
and class weights folded into sample weights (checked: a class with no weight is an
error).

Arrays are numpy arrays or dicts/lists of them; ragged ids as tf.RaggedTensor or
(values, row_splits) pairs; strings as str/bytes arrays.
"""

from __future__ import annotations

import collections.abc
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


# -- agreeing on the data -----------------------------------------------------------------

def is_source(x) -> bool:
    """A data set that yields its own batches (tf.data, a generator, a PyDataset)."""
    if x is None or isinstance(x, (np.ndarray, tf.Tensor, tf.RaggedTensor, dict, list,
                                   tuple, str, bytes)):
        return False
    return True


def is_python_source(x) -> bool:
    """A source kvcoll reads itself: any iterable or iterator of batches, a generator, a
    PyDataset / Sequence, a kvcoll reader; not arrays and not a tf.data.Dataset."""
    return is_source(x) and not isinstance(x, tf.data.Dataset)


class Source:
    """A Python source of batches (see is_python_source), read by the step functions
    themselves: Keras never converts its batches to tf.data (whose fixed signature
    refuses ids whose count varies, and which peeks at batches on one rank alone)."""

    def __init__(self, data, steps=None):
        self.data = data
        self._it = None
        self._indexed = not isinstance(data, collections.abc.Iterable) and \
            hasattr(data, "__getitem__") and hasattr(data, "__len__")
        self._one_shot = isinstance(data, collections.abc.Iterator)

    @property
    def length(self) -> int | None:
        try:
            return None if self._one_shot else len(self.data)
        except TypeError:
            return None

    def new_pass(self) -> None:
        """An epoch begins: a new pass over the data (a one-shot iterator goes on)."""
        if self._one_shot:
            self._it = self._it or self.data
            return
        if self._indexed and self._it is not None and hasattr(self.data, "on_epoch_end"):
            self.data.on_epoch_end()
        self._it = (self.data[i] for i in range(len(self.data))) if self._indexed \
            else iter(self.data)

    def iterator(self):
        if self._it is None:
            self.new_pass()
        return self._it


def stand_in(count: int | None) -> tf.data.Dataset:
    """What Keras iterates in place of a Python source: step numbers, `count` of them,
    or of unknown length (the step functions end the pass)."""
    if count is not None:
        return tf.data.Dataset.range(count)
    return tf.data.Dataset.range(1).repeat().filter(lambda i: tf.constant(True))


def local_batches(x, batch_size, steps) -> int | None:
    """This rank's number of batches, None if unknown (generators, streams)."""
    count = None
    if isinstance(x, tf.data.Dataset):
        c = int(x.cardinality().numpy())
        count = c if c >= 0 else None
    elif is_python_source(x):
        count = Source(x).length
    elif x is not None:
        n = num_samples(x)
        count = math.ceil(n / (batch_size or 32)) if n is not None else None
    if steps is not None:
        count = int(steps) if count is None else min(int(steps), count)
    return count


def num_samples(x) -> int | None:
    for leaf in tf.nest.flatten(x, expand_composites=False):
        if isinstance(leaf, tf.RaggedTensor):
            return int(leaf.nrows())
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
    return None


def agreed(eng, op: str, local):
    """Run local(), this rank's part of a set-up (it may fail, e.g. on bad arguments),
    which returns its number of batches (None: unknown), and agree with every rank (a
    collective): a failure on any rank raises on every rank. Returns (this rank's count,
    the count every rank shares or None)."""
    try:
        mine, err = local(), None
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        mine, err = None, exc
    got = eng.comm.allgather(np.array([-1 if mine is None else mine, int(err is not None)],
                                      np.int64), op=op)
    if got[:, 1].any():
        texts = eng.comm.allgather_json(None if err is None else
                                        f"{type(err).__name__}: {err}", op + ":errors")
        if err is not None:
            raise err
        bad = [r for r, t in enumerate(texts) if t]
        raise InvalidArgumentError(f"rank(s) {bad} could not set up {op}: {texts[bad[0]]}")
    counts = got[:, 0]
    shared = int(counts[0]) if (counts >= 0).all() and (counts == counts[0]).all() else None
    return mine, shared


def keras_arrays(x):
    """Arrays as Keras' array adapter takes them: string ids (numpy str, bytes or object
    arrays) as tf.string tensors, and (values, row_splits) pairs of multi-hot ids as
    tf.RaggedTensor (one row per sample)."""
    if x is None or is_source(x):
        return x

    def leaf(v):
        if isinstance(v, tuple) and len(v) == 2 and all(
                isinstance(a, (np.ndarray, tf.Tensor)) and len(a.shape) == 1 for a in v):
            return tf.RaggedTensor.from_row_splits(v[0], np.asarray(v[1], np.int64))
        if isinstance(v, np.ndarray) and v.dtype.kind in "USO":
            return tf.constant(v.astype(object) if v.dtype.kind == "U" else v, tf.string)
        return v

    if isinstance(x, dict):
        return {k: leaf(v) for k, v in x.items()}
    if isinstance(x, list):
        return [leaf(v) for v in x]
    if isinstance(x, tuple):
        return tuple(leaf(v) for v in x)
    return leaf(x)


def local_data(run, kind, x, y, sw, batch_size, class_weight, steps) -> int | None:
    """This rank's part of agreeing on a pass's data: a Python source becomes the step
    functions' own (run.source); returns its number of batches (None: unknown)."""
    if is_python_source(x):
        if y is not None or sw is not None or class_weight:
            raise InvalidArgumentError(
                f"y, sample_weight and class_weight must be None when x is a "
                f"{type(x).__name__} (it yields (x, y[, sample_weight]) itself)")
        run.source[kind] = Source(x, steps)
    else:
        run.source[kind] = None
    return local_batches(x, batch_size, steps)


def keras_data(run, kind, mine, shared, x, y, sw, batch_size, shuffle, class_weight, steps):
    """The data as Keras gets it, once the counts are agreed: a stand-in for a Python
    source; data of unknown length when the ranks' counts differ or one is unknown (so
    the step functions end the pass when every rank's data has). Returns (x, y, sw,
    class_weight, steps)."""
    if run.source[kind] is not None:
        return stand_in(shared), None, None, None, shared
    x = keras_arrays(x)
    if shared is not None or mine is None:
        return x, y, sw, class_weight, steps
    # Keras would stop at this rank's own count: data of unknown length instead
    if isinstance(x, tf.data.Dataset):
        return x.filter(lambda *a: tf.constant(True)), y, sw, class_weight, None
    if class_weight:
        x, y, sw = with_class_weight((x, y, sw), class_weight)
    parts = tuple(p for p in (x, y, sw) if p is not None)
    ds = tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])
    if shuffle:
        ds = ds.shuffle(max(1, num_samples(x) or 1), reshuffle_each_iteration=True)
    ds = ds.batch(batch_size or 32).filter(lambda *a: tf.constant(True))
    return ds, None, None, None, None
