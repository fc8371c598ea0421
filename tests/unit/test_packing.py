"""How a step's rows and positions reach the compiled step: one 64-byte aligned
buffer, shared with TensorFlow without a copy when it can be, copied when not."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvcoll.exchange.bsp import _split_by_table, aligned_empty  # noqa: E402
from kvcoll.keras import _joined, _tensor  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint32])
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 100_003])
def test_aligned_empty(n, dtype):
    a = aligned_empty(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.c_contiguous
    assert n == 0 or a.ctypes.data % 64 == 0  # an empty array has no memory to align
    a[:] = 7
    assert (a == 7).all()


def test_split_by_table_lays_tables_back_to_back():
    # 2 sources x 3 tables, payload grouped by source, then table
    counts = np.array([[2, 0, 1], [1, 3, 2]])
    payload = np.arange(counts.sum(), dtype=np.float32)
    parts = _split_by_table(payload, counts)
    assert [p.tolist() for p in parts] == [[0, 1, 3], [4, 5, 6], [2, 7, 8]]
    joined = _joined([p.reshape(-1, 1) for p in parts])
    assert np.shares_memory(joined, parts[0]) and joined.ctypes.data % 64 == 0
    assert joined.ravel().tolist() == [0, 1, 3, 4, 5, 6, 2, 7, 8]


def test_joined_copies_parts_that_are_not_back_to_back():
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    parts = [a[0:2], a[3:6]]  # a gap: row 2
    joined = _joined(parts)
    assert not np.shares_memory(joined, a)
    assert joined.tolist() == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]
    b = np.ones((2, 2), np.float32)
    assert _joined([a[:1], b]).tolist() == [[0, 1], [1, 1], [1, 1]]  # two buffers
    assert _joined([a[1:3]]).tolist() == [[2, 3], [4, 5]]


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
