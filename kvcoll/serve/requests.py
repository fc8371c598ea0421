"""Requests as kvcoll serve takes them: TensorFlow Serving's gRPC PredictRequest and
its REST JSON ("instances" rows or "inputs" columns), checked against the published
signature and turned into a `Batch` the model runs. A bad request raises BadRequest
with a message naming the input, what it got and what it takes; the servers answer it
as TensorFlow Serving does (HTTP 400 {"error": ...}, gRPC INVALID_ARGUMENT).

Inputs are named as kv.export's serving signature names them (signature()["inputs"]
[i]["arg"]). An id input takes int ids (any integer dtype) or raw strings, hashed with
the model's id hash exactly as training hashed them. A multi-hot id input takes a 2-D
[batch, width] array (its padding id, if it has one, dropped) or, as kv.export's
signature, the flat ids with `<name>_row_splits`. Other inputs take their Keras dtype
(ints are cast to a float input) and shape.
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np

from .. import ids as _ids

__all__ = ["BadRequest", "Batch", "Signature", "merge"]


class BadRequest(ValueError):
    """A request the model cannot take (TF Serving's INVALID_ARGUMENT)."""


@dataclasses.dataclass
class Batch:
    """One request's (or several merged requests') inputs, checked: n samples; ids:
    input -> (int64 keys, row_splits int64 or None); numeric: input -> array."""

    n: int
    ids: dict
    numeric: dict


class Signature:
    """The published signature (the graph's signature.json) and the checks a request
    goes through."""

    def __init__(self, sig: dict, max_batch: int):
        self.raw = sig
        self.inputs = {e["arg"]: e for e in sig["inputs"]}
        self.tables = sig["tables"]
        self.outputs = list(sig["outputs"])
        self.id_hash = sig["id_hash"]
        self.max_batch = int(max_batch)
        self.splits = {e["arg"] + "_row_splits": e["arg"] for e in sig["inputs"]
                       if e["kind"] == "ids" and e["multi_hot"]}

    def names(self) -> list:
        return sorted(self.inputs)

    def check(self, arrays: dict) -> Batch:
        """arrays: input name -> numpy array (object arrays of str/bytes for strings)."""
        unknown = sorted(set(arrays) - set(self.inputs) - set(self.splits))
        missing = sorted(set(self.inputs) - set(arrays))
        if unknown or missing:
            raise BadRequest(f"the request's inputs do not match the model's: unknown "
                             f"{unknown}, missing {missing}; the model takes "
                             f"{self.names()} (a multi-hot input also as flat ids with "
                             f"<name>_row_splits)")
        n, ids, numeric, sizes = None, {}, {}, {}
        for name, e in self.inputs.items():
            value = np.asarray(arrays[name])
            if e["kind"] == "ids":
                keys, splits = self._ids(name, e, value, arrays.get(name + "_row_splits"))
                ids[name] = (keys, splits)
                sizes[name] = keys.size if splits is None else splits.size - 1
            else:
                numeric[name] = self._numeric(name, e, value)
                sizes[name] = numeric[name].shape[0]
        if len(set(sizes.values())) > 1:
            raise BadRequest(f"the inputs have different batch sizes: {sizes}; give every "
                             "input one entry per sample")
        n = next(iter(sizes.values())) if sizes else 0
        if n > self.max_batch:
            raise BadRequest(f"a batch of {n} samples is over this server's limit of "
                             f"{self.max_batch} (--max-batch); split the request")
        return Batch(int(n), ids, numeric)

    def _ids(self, name, e, value, splits):
        if value.dtype.kind in "USO":
            flat = value.reshape(-1)
            if flat.dtype.kind == "O" and not all(isinstance(v, (str, bytes)) for v in flat):
                raise BadRequest(f"input {name!r}: ids must be all integers or all strings")
            keys = _ids.hash_strings(flat, self.id_hash).reshape(value.shape) \
                if flat.size else np.zeros(value.shape, np.int64)
        elif value.dtype.kind in "iu":
            if value.dtype == np.uint64 and value.size and value.max() > np.iinfo(np.int64).max:
                raise BadRequest(f"input {name!r}: uint64 ids above 2**63 - 1; send int64")
            keys = value.astype(np.int64)
        else:
            raise BadRequest(f"input {name!r}: ids must be integers or strings, got "
                             f"{value.dtype}")
        if not e["multi_hot"]:
            if splits is not None:
                raise BadRequest(f"input {name!r} is one id per sample: it takes no "
                                 f"{name}_row_splits")
            if keys.ndim != 1:
                raise BadRequest(f"input {name!r}: one id per sample, shape [batch]; got "
                                 f"shape {list(keys.shape)}")
            return np.ascontiguousarray(keys), None
        if splits is not None:
            s = np.asarray(splits)
            if s.dtype.kind not in "iu" or s.ndim != 1 or keys.ndim != 1 or s.size < 1 or \
                    s[0] != 0 or s[-1] != keys.size or (np.diff(s) < 0).any():
                raise BadRequest(f"input {name!r}: {name}_row_splits must be int [batch + 1] "
                                 f"from 0 to the {keys.size} ids, non-decreasing")
            return np.ascontiguousarray(keys), s.astype(np.int64)
        if keys.ndim != 2:
            raise BadRequest(f"input {name!r} is multi-hot: send [batch, width] ids, or "
                             f"flat ids with {name}_row_splits; got shape {list(keys.shape)}")
        keep = np.ones(keys.shape, bool) if e["padding_id"] is None \
            else keys != e["padding_id"]
        splits = np.zeros(keys.shape[0] + 1, np.int64)
        np.cumsum(keep.sum(axis=1), out=splits[1:])
        return np.ascontiguousarray(keys[keep]), splits

    def _numeric(self, name, e, value):
        want = np.dtype(e["dtype"])
        if value.dtype.kind not in "biuf" or (want.kind in "iub" and value.dtype.kind == "f"):
            raise BadRequest(f"input {name!r} takes {want.name}, got {value.dtype}")
        shape = e["shape"]
        if value.ndim != len(shape) or any(s is not None and s != v
                                           for s, v in zip(shape[1:], value.shape[1:])):
            raise BadRequest(f"input {name!r} takes shape {['batch'] + shape[1:]}, got "
                             f"{list(value.shape)}")
        return np.ascontiguousarray(value, want)


def merge(batches: list) -> tuple[Batch, list]:
    """Several checked batches as one (concatenated sample by sample), and each one's
    (start, end) in it."""
    if len(batches) == 1:
        return batches[0], [(0, batches[0].n)]
    first = batches[0]
    bounds, at = [], 0
    for b in batches:
        bounds.append((at, at + b.n))
        at += b.n
    ids = {}
    for name, (_, splits) in first.ids.items():
        keys = np.concatenate([b.ids[name][0] for b in batches])
        if splits is None:
            ids[name] = (keys, None)
            continue
        parts, base = [np.zeros(1, np.int64)], 0
        for b in batches:
            s = b.ids[name][1]
            parts.append(s[1:] + base)
            base += int(s[-1])
        ids[name] = (keys, np.concatenate(parts))
    numeric = {name: np.concatenate([b.numeric[name] for b in batches])
               for name in first.numeric}
    return Batch(at, ids, numeric), bounds


# -- REST JSON ---------------------------------------------------------------------------

def _json_value(v):
    """b64 objects ({"b64": ...}) as bytes, lists recursively."""
    if isinstance(v, dict):
        if set(v) == {"b64"} and isinstance(v["b64"], str):
            try:
                return base64.b64decode(v["b64"], validate=True)
            except ValueError:
                raise BadRequest("a {\"b64\": ...} value is not valid base64") from None
        raise BadRequest(f"a value is a JSON object {sorted(v)}; only {{\"b64\": ...}} is "
                         "taken as a value")
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    return v


def _array(v, name):
    v = _json_value(v)
    try:
        arr = np.array(v)
    except ValueError:
        raise BadRequest(f"input {name!r}: the values are ragged (rows of different "
                         "lengths); pad them, or send flat ids with <name>_row_splits") \
            from None
    if arr.dtype.kind == "U" or (arr.dtype.kind == "O" and arr.size and
                                 isinstance(arr.reshape(-1)[0], bytes)):
        arr = arr.astype(object)
    if arr.dtype.kind == "O" and arr.size and not all(
            isinstance(x, (str, bytes)) for x in arr.reshape(-1)):
        raise BadRequest(f"input {name!r}: the values are not all numbers or all strings")
    return arr


def from_json(body, sig: Signature) -> tuple[dict, str]:
    """(input name -> array, "row" or "column") of a REST predict body."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object with \"instances\" or "
                         "\"inputs\"")
    has_i, has_c = "instances" in body, "inputs" in body
    if has_i == has_c:
        raise BadRequest("the request body must have exactly one of \"instances\" (rows) "
                         "and \"inputs\" (columns)")
    names = sig.names()
    if has_i:
        rows = body["instances"]
        if not isinstance(rows, list) or not rows:
            raise BadRequest("\"instances\" must be a non-empty list of samples")
        if all(isinstance(r, dict) for r in rows):
            keys = set(rows[0])
            if any(set(r) != keys for r in rows):
                raise BadRequest("every instance must name the same inputs")
            return {k: _array([r[k] for r in rows], k) for k in keys}, "row"
        if len(names) != 1:
            raise BadRequest(f"\"instances\" must be objects naming the inputs {names}: the "
                             "model has several")
        return {names[0]: _array(rows, names[0])}, "row"
    cols = body["inputs"]
    if isinstance(cols, dict):
        return {k: _array(v, k) for k, v in cols.items()}, "column"
    if len(names) != 1:
        raise BadRequest(f"\"inputs\" must be an object naming the inputs {names}: the model "
                         "has several")
    return {names[0]: _array(cols, names[0])}, "column"


def to_json(outputs: dict, form: str, sig: Signature, wanted=None) -> dict:
    """A REST predict response as TF Serving writes it."""
    names = [n for n in sig.outputs if wanted is None or n in wanted]
    if form == "row":
        if len(names) == 1:
            return {"predictions": outputs[names[0]].tolist()}
        n = outputs[names[0]].shape[0]
        return {"predictions": [{k: outputs[k][i].tolist() for k in names} for i in range(n)]}
    if len(names) == 1:
        return {"outputs": outputs[names[0]].tolist()}
    return {"outputs": {k: outputs[k].tolist() for k in names}}
