"""The synthetic CTR set's C bindings: id scrambling, sample generation and the planted
logit (csrc/synth/kv_synth.h, the data generator's own extension, not kvcoll's C core),
for kvcoll.data.synthetic.

synthetic.py derives the parameters (vocabularies, permutation rounds, the planted
model's weights) in Python; these classes check their dtypes and shapes, hand them to C
once, and then generate any range of samples in one C call, bit for bit the same in any
batch, chunk or rank slice.
"""

from __future__ import annotations

import numpy as np

from .. import errors
from .._c import check

try:
    from ._kvsynth_c import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only without a build
    raise ImportError(
        "kvcoll's synthetic data extension is not built: run `./dev build` (or `pip "
        f"install .`) from the kvcoll checkout ({exc})") from exc

__all__ = ["SynthPermutation", "SynthModel", "SYNTH_PERM_ROUNDS"]

SYNTH_PERM_ROUNDS = lib.KV_SYNTH_PERM_ROUNDS


def ptr(ctype: str, arr: np.ndarray):
    """A pointer of this extension's ffi to a checked, contiguous array (zero copy)."""
    return ffi.cast(ctype, ffi.from_buffer(arr))


def _synth_array(value, dtype, shape, what: str) -> np.ndarray:
    """value as a C-contiguous array, checked to be exactly dtype and shape (a None in
    shape matches any length)."""
    arr = np.asarray(value)
    if arr.dtype != dtype:
        raise errors.InvalidArgumentError(f"{what} must be {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != len(shape) or any(s is not None and s != a for s, a in zip(shape, arr.shape)):
        want = "(" + ", ".join("n" if s is None else str(s) for s in shape) + ")"
        raise errors.DimensionError(f"{what} must have shape {want}, got {arr.shape}")
    return np.ascontiguousarray(arr)


class SynthPermutation:
    """SyntheticCTR's per-field id scrambling in C (kv_synth_perm_t, kv_synth.h).

    vocab, mask, shift: uint64 [F]; add, mul, inv: uint64 [SYNTH_PERM_ROUNDS, F];
    rot: uint64 [SYNTH_PERM_ROUNDS - 1, F]. The C side checks them once, here.
    """

    def __init__(self, vocab, mask, shift, add, mul, inv, rot):
        nf = np.asarray(vocab).size
        r = SYNTH_PERM_ROUNDS
        u64 = np.uint64
        arrays = {"vocab": _synth_array(vocab, u64, (nf,), "vocab"),
                  "mask": _synth_array(mask, u64, (nf,), "mask"),
                  "shift": _synth_array(shift, u64, (nf,), "shift"),
                  "add": _synth_array(add, u64, (r, nf), "add"),
                  "mul": _synth_array(mul, u64, (r, nf), "mul"),
                  "inv": _synth_array(inv, u64, (r, nf), "inv"),
                  "rot": _synth_array(rot, u64, (r - 1, nf), "rot")}
        self.num_fields = nf
        self._arrays = arrays                       # the C struct points into these
        self._c = ffi.new("kv_synth_perm_t *")
        self._c.num_fields = nf
        for name, arr in arrays.items():
            setattr(self._c, name, ptr("uint64_t *", arr))
        check(lib.kv_synth_perm_check(self._c), "synthetic id permutation")

    def apply(self, values, inverse: bool = False) -> np.ndarray:
        """perm_f (or its inverse) of every values[i, f] (uint64 [n, F], < vocab_f)."""
        x = _synth_array(values, np.uint64, (None, self.num_fields), "values")
        out = np.empty_like(x)
        check(lib.kv_synth_permute(self._c, ptr("uint64_t *", x), x.shape[0], int(bool(inverse)),
                                   ptr("uint64_t *", out)), "synthetic id permutation")
        return out


class SynthModel:
    """SyntheticCTR's sample generator and planted model in C (kv_synth_t, kv_synth.h).

    perm: a SynthPermutation (F fields); zipf_c, per field, float64 [F]; offsets int64
    [F]; param_keys uint64 [F]; w_mul, w_sub, v_mul, v_sub float32 [F]; mu, sigma,
    center, beta float32 [D]. The C side checks them once, here.
    """

    def __init__(self, perm: SynthPermutation, *, num_numeric: int, log_uniform: bool,
                 zipf_exponent: float, zipf_c, offsets, param_keys, w_mul, w_sub, v_mul,
                 v_sub, mu, sigma, center, beta, bias: float = 0.0):
        nf, nd = perm.num_fields, int(num_numeric)
        if nd < 0:
            raise errors.InvalidArgumentError(f"num_numeric must be >= 0, got {nd}")
        f32 = np.float32
        arrays = {"zipf_c": ("double *", _synth_array(zipf_c, np.float64, (nf,), "zipf_c")),
                  "offsets": ("int64_t *", _synth_array(offsets, np.int64, (nf,), "offsets")),
                  "param_keys": ("uint64_t *",
                                 _synth_array(param_keys, np.uint64, (nf,), "param_keys"))}
        for name, value in (("w_mul", w_mul), ("w_sub", w_sub), ("v_mul", v_mul),
                            ("v_sub", v_sub)):
            arrays[name] = ("float *", _synth_array(value, f32, (nf,), name))
        for name, value in (("mu", mu), ("sigma", sigma), ("center", center), ("beta", beta)):
            arrays[name] = ("float *", _synth_array(value, f32, (nd,), name))
        self.num_fields, self.num_numeric = nf, nd
        self._perm = perm                           # the C structs point into these
        self._arrays = arrays
        self._c = ffi.new("kv_synth_t *")
        self._c.perm = perm._c[0]
        self._c.num_numeric = nd
        self._c.log_uniform = int(bool(log_uniform))
        self._c.zipf_exponent = float(zipf_exponent)
        self._c.bias = float(bias)
        for name, (ctype, arr) in arrays.items():
            setattr(self._c, name, ptr(ctype, arr))
        check(lib.kv_synth_check(self._c), "synthetic data parameters")

    def samples(self, keys, first: int, n: int, *, logit: bool = False):
        """Samples first, ..., first + n - 1 of the stream with channel keys `keys`
        (uint64 [F + D + 1]): ({"categorical", "numeric", "label"}, logit float64 [n]
        or None)."""
        nf, nd, n = self.num_fields, self.num_numeric, int(n)
        k = _synth_array(keys, np.uint64, (nf + nd + 1,), "keys")
        if n < 0:
            raise errors.InvalidArgumentError(f"n must be >= 0, got {n}")
        out = {"categorical": np.empty((n, nf), np.int64),
               "numeric": np.empty((n, nd), np.float32),
               "label": np.empty(n, np.float32)}
        lg = np.empty(n, np.float64) if logit else None
        check(lib.kv_synth_samples(
            self._c, ptr("uint64_t *", k), int(first), n,
            ptr("int64_t *", out["categorical"]), ptr("float *", out["numeric"]),
            ptr("float *", out["label"]), ffi.NULL if lg is None else ptr("double *", lg)),
            "synthetic samples")
        return out, lg

    def logit(self, ranks, numeric) -> np.ndarray:
        """The planted logit (float64 [n]) of ranks (uint64 [n, F], not ids) and
        numeric (float32 [n, D]): bit for bit the one `samples` drew the labels from."""
        r = _synth_array(ranks, np.uint64, (None, self.num_fields), "ranks")
        x = _synth_array(numeric, np.float32, (r.shape[0], self.num_numeric), "numeric")
        out = np.empty(r.shape[0], np.float64)
        check(lib.kv_synth_logit(self._c, ptr("uint64_t *", r), ptr("float *", x), r.shape[0],
                                 ptr("double *", out)), "synthetic planted logit")
        return out
