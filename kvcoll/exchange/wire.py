"""The width of rows and row gradients on the wire: float32, fp16 or bf16.

A `Wire` converts a payload of float32 rows (or row gradients) to the 16-bit values the
exchange sends, and back, each in one C call (csrc/kv_wire.h: round to nearest even;
vectorised). Only the payload is narrow: the tables, the owners' gradient sums and
the row optimizers stay float32, and the model reads float32 rows (each one rounded to
the wire's precision). The ids, the dense gradient and the votes are never narrowed.

A payload is cut into segments, one per destination rank (or one per message in
SSP/ASP). bf16 sends the values as they are rounded. fp16 sends each segment with its
own power-of-two scale (one 16-bit exponent ahead of its values): its largest value lands
just below 2^15, so every value keeps fp16's 11 significant bits relative to the largest
of its segment, whatever the magnitudes. That matters for gradients: a mean loss over a
global batch of thousands gives row gradients of 1e-5 and below, most of which plain
fp16 would hold as subnormals (fewer bits) or round to zero; and it means no finite value
overflows fp16.

Every row and gradient of a step goes through the same rounding, including the part a
rank owns itself (which never crosses the wire: it is rounded as a segment of its own).

A finite value beyond bf16's range (within 0.2% of float32's largest) would arrive as
Inf: the step is refused on every rank, nothing is applied, and the error names the
table, the key, the value and the fix. Rounding it to the largest finite value instead
would train on a silently clipped number.

    wire = Wire.of("fp16")
    packed, bad = wire.pack(rows, per_rank)      # uint16; the first value that overflowed
    rows, bad = wire.unpack(packed, per_rank)    # float32 (64-byte aligned); first NaN/Inf
    wire.counts(per_rank)                        # wire values per destination
"""

from __future__ import annotations

import numpy as np

from .. import errors, runtime
from .._buffers import aligned_empty
from .._c import check, lib, ptr
from ..config import WIRE_DTYPES, Config
from .kernels import pool

__all__ = ["FP32", "WIRE_DTYPES", "Wire", "wire_of"]

_LIMITS = {"fp16": "magnitude below 65520 (largest finite fp16: 65504)",
           "bf16": "magnitude below 3.3962e38 (largest finite bf16: 3.3895e38)"}


class Wire:
    """One wire format: name ("fp32", "fp16" or "bf16"), itemsize (bytes per value on
    the wire) and dtype (the numpy dtype of a packed payload: float32 or uint16)."""

    __slots__ = ("_fmt", "dtype", "itemsize", "name")

    def __init__(self, name: str):
        if name not in WIRE_DTYPES:
            raise errors.InvalidArgumentError(
                f"wire_dtype {name!r} is unknown; use one of {', '.join(WIRE_DTYPES)} "
                "(kv.init(wire_dtype=...), --wire-dtype, KVCOLL_WIRE_DTYPE)")
        self.name = name
        self._fmt = {"fp32": lib.KV_WIRE_F32, "fp16": lib.KV_WIRE_F16,
                     "bf16": lib.KV_WIRE_BF16}[name]
        self.itemsize = 4 if name == "fp32" else 2
        self.dtype = np.dtype(np.float32 if name == "fp32" else np.uint16)

    @classmethod
    def of(cls, setting) -> Wire:
        """A Wire given as a Wire or a name."""
        return setting if isinstance(setting, Wire) else cls(setting)

    @property
    def compact(self) -> bool:
        """Whether values are narrowed (fp16, bf16)."""
        return self.name != "fp32"

    def __repr__(self) -> str:
        return f"Wire({self.name!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Wire) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def counts(self, values) -> np.ndarray:
        """Wire values of segments of `values` floats each (int64): fp16 adds one (the
        exponent) to every segment that is not empty."""
        n = np.asarray(values, np.int64)
        return n + (n > 0) if self.name == "fp16" else n.copy()

    def pack(self, values: np.ndarray, segments=None, out: np.ndarray | None = None
             ) -> tuple[np.ndarray, int]:
        """values (float32, C-contiguous) as the wire's values: (packed, index of the first
        finite value that overflowed, or -1). segments: values per segment (default: one
        segment of them all). fp32: values themselves. out: a uint16 array to write into
        (default a new one)."""
        values = _floats(values, "pack")
        if not self.compact:
            return values, -1
        seg = self._segments(segments, values.size, "pack")
        need = int(self.counts(seg).sum())
        if out is None:
            out = np.empty(need, np.uint16)
        elif out.dtype != np.uint16 or out.size != need or not out.flags.c_contiguous:
            raise errors.InvalidArgumentError(
                f"wire pack: out must be C-contiguous uint16 of {need} values, got "
                f"{out.dtype} of {out.size}")
        first = np.empty(1, np.int64)
        check(lib.kv_wire_pack_segments(pool(), self._fmt, ptr("float *", values),
                                        ptr("int64_t *", seg), seg.size,
                                        ptr("uint16_t *", out), ptr("int64_t *", first)),
              f"wire pack ({self.name})")
        return out, int(first[0])

    def unpack(self, packed: np.ndarray, segments=None, out: np.ndarray | None = None
               ) -> tuple[np.ndarray, int]:
        """Wire values back to float32: (float32 array, 64-byte aligned, index of the
        first NaN/Inf value, or -1). segments: values per segment, as packed (default: one
        segment). fp32: packed itself (no check), or copied into out. out: a float32 array
        to write into (default a new aligned one)."""
        if not self.compact:
            packed = _floats(packed, "unpack")
            if out is None:
                return packed, -1
            out.reshape(-1)[:] = packed
            return out, -1
        packed = np.ascontiguousarray(packed).reshape(-1)
        if packed.dtype != np.uint16:
            raise errors.InvalidArgumentError(
                f"wire unpack ({self.name}): packed values must be uint16, got {packed.dtype}")
        if segments is None:
            segments = [packed.size - int(self.name == "fp16" and packed.size > 0)]
        seg = self._segments(segments, None, "unpack")
        if int(self.counts(seg).sum()) != packed.size:
            raise errors.InvalidArgumentError(
                f"wire unpack ({self.name}): {packed.size} wire values do not hold segments "
                f"of {seg.tolist()[:8]} values")
        n = int(seg.sum())
        if out is None:
            out = aligned_empty(n, np.float32)
        elif out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous:
            raise errors.InvalidArgumentError(
                f"wire unpack: out must be C-contiguous float32 of {n} values, got "
                f"{out.dtype} of {out.size}")
        first = np.empty(1, np.int64)
        check(lib.kv_wire_unpack_segments(pool(), self._fmt, ptr("uint16_t *", packed),
                                          ptr("int64_t *", seg), seg.size,
                                          ptr("float *", out), ptr("int64_t *", first)),
              f"wire unpack ({self.name})")
        return out, int(first[0])

    def round(self, values: np.ndarray) -> int:
        """Round float32 values in place to what they read after crossing the wire as one
        segment; returns the index of the first finite value that overflowed (it becomes
        +-Inf), or -1. fp32: nothing."""
        if not self.compact or not values.size:
            return -1
        flat = values.reshape(-1)
        if not flat.flags.c_contiguous or flat.dtype != np.float32:
            raise errors.InvalidArgumentError("wire round: values must be C-contiguous float32")
        packed, bad = self.pack(flat)
        self.unpack(packed, out=flat)
        return bad

    def overflow_error(self, what: str, value: float | None, step: int
                       ) -> errors.NonFiniteError:
        """The error of a finite value that does not fit the wire (what: whose value;
        value: the float32 value, None when only its Inf on arrival is known)."""
        told = f"is {value:g}, " if value is not None else "was "
        return errors.NonFiniteError(
            f"step {step}: {what} {told}beyond {self.name}'s range "
            f"({_LIMITS[self.name]}): it cannot cross the wire as {self.name}, so the step "
            "was refused on every rank and nothing was applied. Send rows as fp16 (scaled "
            "per message: every finite float32 fits) or fp32 instead (kv.init(wire_dtype="
            "'fp16'), --wire-dtype fp16, KVCOLL_WIRE_DTYPE=fp16), or find why the value is "
            "so large")

    @staticmethod
    def _segments(segments, total, what: str) -> np.ndarray:
        seg = np.ascontiguousarray(np.asarray(
            [total] if segments is None else segments, np.int64).reshape(-1))
        if (seg < 0).any() or (total is not None and int(seg.sum()) != total):
            raise errors.InvalidArgumentError(
                f"wire {what}: segments of {seg.tolist()[:8]} values do not cut "
                f"{total} values")
        return seg


FP32 = Wire("fp32")


def wire_of(setting=None) -> Wire:
    """The Wire of `setting` (a name or a Wire); None: the run's (kv.init(wire_dtype=),
    --wire-dtype, KVCOLL_WIRE_DTYPE; "fp32" by default)."""
    if setting is None:
        cfg = runtime.config() if runtime.is_initialized() else Config.resolve([])
        setting = cfg.wire_dtype
    return Wire.of(setting)


def _floats(values, what: str) -> np.ndarray:
    if not isinstance(values, np.ndarray) or values.dtype != np.float32:
        raise errors.InvalidArgumentError(
            f"wire {what}: values must be a float32 numpy array, got "
            f"{getattr(values, 'dtype', type(values).__name__)}")
    return np.ascontiguousarray(values).reshape(-1)
