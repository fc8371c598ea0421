"""One rank's data for fit / evaluate / predict, batch by batch.

Each rank passes its own part of the data, as a Horovod user does (kv.data.shard cuts
a tf.data.Dataset or a sequence by rank): numpy arrays or dicts/lists of them (ragged
ids as tf.RaggedTensor or (values, row_splits) pairs; strings as str/bytes arrays),
tensors, a tf.data.Dataset of batches, a keras.utils.PyDataset, or any iterable or
generator of (x, y[, sample_weight]) batches. `batch_size` is per rank. A Feed yields
the rank's raw batches for one epoch at a time; kvcoll's step checks and normalises
them, and ranks whose data ran out keep the others company until every rank is done.
"""

from __future__ import annotations

import collections.abc
import math

import numpy as np
import tensorflow as tf

from ..errors import InvalidArgumentError
from .batch import leaves_of, unpack

__all__ = ["Feed", "split_validation", "with_class_weight"]


class Feed:
    """This rank's data: epoch(e) yields its batches (x, y, sample_weight) for epoch e.

    steps: at most this many batches per epoch (for datasets and generators, the
    iterator then runs on across epochs, as in Keras). shuffle: arrays only, a new
    order every epoch. class_weight: {class: weight} for a single output, folded into
    the sample weights.
    """

    def __init__(self, x, y=None, sample_weight=None, batch_size=None, *, shuffle=False,
                 steps=None, class_weight=None):
        if steps is not None and (isinstance(steps, bool) or int(steps) < 1):
            raise InvalidArgumentError(f"steps must be a positive integer, got {steps!r}")
        self.steps = None if steps is None else int(steps)
        self.class_weight = class_weight
        self._it = None
        if _is_dataset(x) or _is_iterable_source(x):
            if y is not None or sample_weight is not None:
                raise InvalidArgumentError(
                    f"y and sample_weight must be None when x is a {type(x).__name__} (it "
                    "yields (x, y[, sample_weight]) itself)")
            if batch_size is not None and _is_dataset(x):
                raise InvalidArgumentError(
                    "batch_size must be None for a tf.data.Dataset: batch the dataset itself")
            self.kind = "dataset" if _is_dataset(x) else "iterable"
            self._source = x
            self.num_batches = _cardinality(x)
            if self.steps is not None:
                self.num_batches = self.steps if self.num_batches is None \
                    else min(self.steps, self.num_batches)
            return
        self.kind = "arrays"
        self.batch_size = 32 if batch_size is None else int(batch_size)
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size!r}")
        self.shuffle = bool(shuffle)
        self._x = _arrays(x, "x")
        self._y = None if y is None else _arrays(y, "y")
        self._sw = None if sample_weight is None else _arrays(sample_weight, "sample_weight")
        self.n = _length(self._x)
        for what, v in (("y", self._y), ("sample_weight", self._sw)):
            if v is not None and _length(v) != self.n:
                raise InvalidArgumentError(
                    f"x has {self.n} samples but {what} has {_length(v)}; give one per sample")
        self.num_batches = math.ceil(self.n / self.batch_size)
        if self.steps is not None:
            self.num_batches = min(self.num_batches, self.steps)

    def first(self):
        """This rank's first batch (None if it has none), without using it up."""
        for b in self.epoch(0, peek=True):
            return b
        return None

    def epoch(self, epoch: int, peek: bool = False):
        """This rank's batches of one epoch (peek: only the first, kept for later)."""
        if self.kind == "arrays":
            yield from self._array_epoch(epoch, peek)
            return
        it = self._iterator()
        if peek:
            b = it.peek()
            if b is not None:
                yield self._weighted(_numpy_element(b))
            return
        n = 0
        while self.steps is None or n < self.steps:
            try:
                b = next(it)
            except (StopIteration, tf.errors.OutOfRangeError):
                self._it = None  # the next epoch starts the source again
                if hasattr(self._source, "on_epoch_end"):
                    self._source.on_epoch_end()
                return
            n += 1
            yield self._weighted(_numpy_element(b))

    def _iterator(self) -> "_Peekable":
        if self._it is None:
            src = self._source
            if not isinstance(src, collections.abc.Iterable) and hasattr(src, "__len__"):
                it = (src[i] for i in range(len(src)))  # a PyDataset-like sequence
            else:
                it = iter(src)
            self._it = _Peekable(it)
        return self._it

    def _array_epoch(self, epoch: int, peek: bool):
        order = np.random.permutation(self.n) if self.shuffle and not peek else None
        for i in range(self.num_batches):
            lo, hi = i * self.batch_size, min(self.n, (i + 1) * self.batch_size)
            idx = slice(lo, hi) if order is None else order[lo:hi]
            x = _take_rows(self._x, idx)
            y = None if self._y is None else _take_rows(self._y, idx)
            sw = None if self._sw is None else _take_rows(self._sw, idx)
            yield self._weighted((x, y, sw))
            if peek:
                return

    def _weighted(self, element):
        return with_class_weight(element, self.class_weight)


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
    if _is_dataset(x) or _is_iterable_source(x):
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


# -- sources ----------------------------------------------------------------------------------

def _is_dataset(x) -> bool:
    return isinstance(x, tf.data.Dataset)


def _is_iterable_source(x) -> bool:
    """A generator, iterator, PyDataset or other iterable of batches (not arrays or a
    structure of arrays)."""
    if x is None or isinstance(x, (np.ndarray, tf.Tensor, tf.RaggedTensor, dict, list, tuple,
                                   str, bytes)):
        return False
    return isinstance(x, (collections.abc.Iterator, collections.abc.Iterable)) or \
        (hasattr(x, "__getitem__") and hasattr(x, "__len__"))


def _cardinality(x) -> int | None:
    if _is_dataset(x):
        c = int(x.cardinality().numpy())
        return c if c >= 0 else None
    if hasattr(x, "__len__") and not isinstance(x, collections.abc.Iterator):
        try:
            return len(x)
        except TypeError:
            return None
    return None


class _Peekable:
    def __init__(self, it):
        self._it, self._head = it, []

    def peek(self):
        if not self._head:
            try:
                self._head.append(next(self._it))
            except StopIteration:
                return None
        return self._head[0]

    def __iter__(self):
        return self

    def __next__(self):
        if self._head:
            return self._head.pop()
        return next(self._it)


def _numpy_element(b):
    """A data element with dense tensors as numpy (ragged tensors stay: the step reads
    them)."""
    def conv(v):
        if isinstance(v, tf.Tensor):
            return v.numpy()
        return v
    if isinstance(b, tuple):
        return tuple(_map(conv, v) for v in b)
    return _map(conv, b)


def _map(fn, v):
    if isinstance(v, dict):
        return {k: _map(fn, u) for k, u in v.items()}
    if isinstance(v, list):
        return [_map(fn, u) for u in v]
    return fn(v)


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
