"""The boundary to kvcoll's C core: every module that calls C goes through here.

It loads the cffi extension (with a message saying how to build it when it is missing),
turns C status codes into typed exceptions in exactly one function, `check`, and hands
C zero-copy pointers into numpy arrays the caller has already checked, `ptr`.
"""

from __future__ import annotations

import numpy as np

from . import errors

try:
    from ._kvcoll_c import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only without a build
    raise ImportError(
        "kvcoll's C extension is not built: run `./dev build` (or `pip install .`) "
        f"from the kvcoll checkout ({exc})"
    ) from exc

__all__ = ["ffi", "lib", "check", "ptr", "step32", "EMPTY"]

_ERRORS = {
    lib.KV_ENOMEM: errors.CapacityError,
    lib.KV_EINVAL: errors.InvalidArgumentError,
    lib.KV_ENONFINITE: errors.NonFiniteError,
    lib.KV_EFULL: errors.TableFullError,
    lib.KV_EOPTIM: errors.InvalidArgumentError,
    lib.KV_EINIT: errors.InvalidArgumentError,
}

EMPTY = np.zeros(8, np.int64)  # a valid address for zero-length batches


def check(status: int, what: str) -> None:
    """Turn a C status code into the matching exception (the one place that does)."""
    if status == lib.KV_OK:
        return
    text = ffi.string(lib.kv_strerror(status)).decode()
    raise _ERRORS.get(status, errors.KvcollError)(f"{what}: {text}")


def ptr(ctype: str, arr: np.ndarray):
    """Zero-copy pointer into a checked, C-contiguous array (never NULL)."""
    return ffi.cast(ctype, ffi.from_buffer(arr if arr.size else EMPTY))


def step32(step) -> int:
    """A training step (an integer >= 0) as C's uint32 step counter: the row headers
    keep steps in 32 bits, so a larger step is an error, never truncated."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise errors.InvalidArgumentError(f"step must be an integer >= 0, got {step!r}")
    if step > 0xFFFFFFFF:
        raise errors.InvalidArgumentError(
            f"step {step} does not fit the tables' 32-bit row headers (at most 2**32 - 1 "
            "= 4294967295); a checkpoint or restore with such a step is not supported")
    return int(step)
