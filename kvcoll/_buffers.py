"""Buffers TensorFlow can share without a copy (64-byte aligned numpy arrays)."""

from __future__ import annotations

import numpy as np


def aligned_empty(n: int, dtype, align: int = 64) -> np.ndarray:
    """np.empty(n, dtype) starting on an `align`-byte boundary (what TensorFlow needs
    to use the memory without a copy)."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + n * dtype.itemsize].view(dtype)
