"""A row optimizer applied to float rows outside any table: SSP/ASP's dense slices.

In SSP and ASP the dense parameters are one flat vector cut into slices, each owned and
updated by one rank with the same C optimizer kernels the tables use (kv_optim.h), so
a dense weight and an embedding row follow one update rule. `init_slots` gives a
slice's initial optimizer state and `apply_rows` applies one step in place.
"""

from __future__ import annotations

import numpy as np

from .. import errors
from .._c import ffi, lib, ptr
from ..table import fill_optim

__all__ = ["slot_floats", "init_slots", "apply_rows"]


def _c_optim(optimizer):
    if not hasattr(optimizer, "_c_fields"):
        raise errors.InvalidArgumentError(
            f"optimizer must be a kvcoll.optimizers row optimizer, got {optimizer!r}")
    if optimizer._c_fields()["kind"] == "rowwise_adagrad":
        # One accumulator per table row; a dense slice is no row: its width is where the
        # flat dense vector is cut between ranks, so the rule would change with the world.
        raise errors.InvalidArgumentError(
            "RowWiseAdagrad keeps one accumulator per embedding row and has no meaning "
            "for SSP/ASP's dense slices (cut where the ranks split the dense vector); use "
            "it as the tables' row optimizer, and Adagrad for the dense parameters")
    o = ffi.new("kv_optim_t *")
    fill_optim(o[0], optimizer)
    return o


def _dim_ok(dim) -> int:
    if not isinstance(dim, (int, np.integer)) or not 1 <= dim <= (2**31 - 2) // 3:
        raise errors.InvalidArgumentError(
            f"row width must be an integer in [1, {(2**31 - 2) // 3}], got {dim!r}")
    return int(dim)


def slot_floats(optimizer, dim: int) -> int:
    """Floats of optimizer state per row of width dim (0 for SGD)."""
    return int(lib.kv_optim_slot_floats(_c_optim(optimizer), _dim_ok(dim)))


def init_slots(optimizer, dim: int, nrows: int = 1) -> np.ndarray:
    """The initial optimizer state of `nrows` rows of width dim: (nrows, slot_floats)."""
    o = _c_optim(optimizer)
    dim = _dim_ok(dim)
    out = np.zeros((int(nrows), int(lib.kv_optim_slot_floats(o, dim))), np.float32)
    if out.shape[1]:
        for r in range(out.shape[0]):
            lib.kv_optim_init_slots(o, dim, ffi.cast("float *", ffi.from_buffer(out[r])))
    return out


def apply_rows(optimizer, w: np.ndarray, slots: np.ndarray, g: np.ndarray, step: int) -> None:
    """Apply a row optimizer in place to any float32 rows outside a table (the dense
    slices of SSP/ASP): w (nrows, dim) and slots (nrows, slot_floats) are updated with
    the gradient g (nrows, dim); `step` (>= 1) drives Adam's bias correction. Checks
    every argument and that g is finite before changing anything.

    Not locked: the caller makes sure no other thread touches w and slots meanwhile.
    """
    o = _c_optim(optimizer)
    if not (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2
            and w.flags.c_contiguous and w.flags.writeable):
        raise errors.InvalidArgumentError(
            "apply_rows: w must be a writable C-contiguous float32 (nrows, dim) array, got "
            f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    nrows, dim = w.shape
    dim = _dim_ok(dim)
    ns = int(lib.kv_optim_slot_floats(o, dim))
    if not (isinstance(slots, np.ndarray) and slots.dtype == np.float32
            and slots.shape == (nrows, ns) and slots.flags.c_contiguous
            and slots.flags.writeable):
        raise errors.InvalidArgumentError(
            f"apply_rows: slots must be a writable C-contiguous float32 ({nrows}, {ns}) array, "
            f"got {getattr(slots, 'dtype', type(slots))} {getattr(slots, 'shape', '')}")
    g = np.ascontiguousarray(g, np.float32)
    if g.shape != w.shape:
        raise errors.DimensionError(f"apply_rows: gradient shape {g.shape}, expected {w.shape}")
    if not np.isfinite(g).all():
        raise errors.NonFiniteError("apply_rows: the gradient holds NaN or Inf; nothing changed")
    if not isinstance(step, (int, np.integer)) or step < 1:
        raise errors.InvalidArgumentError(f"apply_rows: step must be an integer >= 1, got {step!r}")
    if nrows == 0:
        return
    lib.kv_optim_apply_rows(o, dim, nrows, ptr("float *", w),
                            ptr("float *", slots) if ns else ffi.NULL,
                            ptr("float *", g), int(step))
