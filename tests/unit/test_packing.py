"""How a step's rows and positions reach the compiled step: one 64-byte aligned
buffer, shared with TensorFlow without a copy when it can be, copied when not."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvcoll._buffers import aligned_empty  # noqa: E402
from kvcoll.keras.compute import _tensor  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint32])
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 100_003])
def test_aligned_empty(n, dtype):
    a = aligned_empty(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.c_contiguous
    assert n == 0 or a.ctypes.data % 64 == 0  # an empty array has no memory to align
    a[:] = 7
    assert (a == 7).all()


def test_tensor_shares_aligned_memory_and_copies_the_rest():
    a = aligned_empty(64, np.float32).reshape(16, 4)
    a[:] = 1
    t = _tensor(a)
    a[0, 0] = 5  # kvcoll never writes after handing over; here it shows the sharing
    assert float(t[0, 0]) == 5.0
    raw = np.ones(65, np.float32)
    off = 1 if raw.ctypes.data % 64 == 0 else 0
    unaligned = raw[off:off + 64].reshape(16, 4)  # TensorFlow would abort on this one
    assert unaligned.ctypes.data % 64 != 0
    u = _tensor(unaligned)
    unaligned[0, 0] = 9
    assert float(u[0, 0]) == 1.0 and float(np.sum(u)) == 64.0
    assert _tensor(np.zeros((0, 3), np.float32)).shape == (0, 3)
