"""How a step's rows and positions reach the compiled step: one 64-byte aligned
buffer, shared with TensorFlow without a copy when it can be, copied when not."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvcoll._buffers import aligned_empty  # noqa: E402
from kvcoll.exchange.bsp import Pull, Pulled, _joined  # noqa: E402
from kvcoll.keras import _tensor  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint32])
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 100_003])
def test_aligned_empty(n, dtype):
    a = aligned_empty(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.c_contiguous
    assert n == 0 or a.ctypes.data % 64 == 0  # an empty array has no memory to align
    a[:] = 7
    assert (a == 7).all()


def test_pull_from_tables_lays_a_groups_tables_back_to_back():
    # per-table pulls (SSP's form): tables of one dim share one matrix, in table order
    buf = aligned_empty(7 * 2, np.float32).reshape(7, 2)
    buf[:] = np.arange(14).reshape(7, 2)
    pulled = {"a": Pulled(np.array([5, 6]), np.array([1, 0, 1]), buf[0:2], np.array([2])),
              "b": Pulled(np.array([7, 8, 9]), np.array([2, 2]), buf[2:5], np.array([3])),
              "c": Pulled(np.array([1]), np.array([0, 0]), np.ones((1, 3), np.float32),
                          np.array([1]))}
    p = Pull.from_tables(pulled)
    assert sorted(p.rows) == ["dim2", "dim3"] and p.group == {"a": "dim2", "b": "dim2", "c": "dim3"}
    assert np.shares_memory(p.rows["dim2"], buf) and p.rows["dim2"].shape == (5, 2)
    assert p.pos["a"].tolist() == [1, 0, 1] and p.pos["b"].tolist() == [4, 4]
    assert p.pos["c"].tolist() == [0, 0]
    grads = {g: m * 10 for g, m in p.rows.items()}
    assert p.table_rows("b", grads).tolist() == (buf[2:5] * 10).tolist()
    assert p["a"] is pulled["a"] and list(p) == ["a", "b", "c"] and len(p) == 3


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
