"""kvcoll serve's overlay: what a request pinned at the old version reads for the keys a
delta changes while the delta is applied in place (kvcoll/serve/model.py)."""

import numpy as np

from kvcoll import optimizers
from kvcoll.serve.model import _Overlay
from kvcoll.table import KvTable


def test_a_request_pinned_at_the_old_version_reads_exactly_the_old_rows():
    rng = np.random.default_rng(0)
    t = KvTable(4, name="item", optimizer=optimizers.SGD(0.01), initial_capacity=64)
    keys = np.arange(0, 40, dtype=np.int64) * 7
    t.update(keys, rng.standard_normal((keys.size, 4)).astype(np.float32))
    removed = keys[[3, 9]]
    changed = np.array([keys[5], keys[5], keys[20], 1001, 1003], np.int64)  # (a repeat;
    staged = {"tables": {"item": {"removed": removed, "keys": changed}}}  # 2 new keys)
    asked = np.array([keys[0], keys[3], keys[5], 1001, keys[9], 5, keys[20], keys[5]],
                     np.int64)
    before = t.find(asked)
    overlay = _Overlay({"item": t}, staged)
    t.delete(removed)                                      # the delta, applied in place
    t.update(changed[1:], np.full((4, 4), 9.0, np.float32))
    rows = t.find(asked)
    assert not np.array_equal(rows, before)
    overlay.restore("item", asked, rows)
    np.testing.assert_array_equal(rows, before)
    empty = np.zeros((0, 4), np.float32)
    overlay.restore("item", np.zeros(0, np.int64), empty)  # no ids: nothing to do
    overlay.restore("user", asked[:2], rows[:2])           # a table the delta left alone
    overlay.close()
    t.close()
