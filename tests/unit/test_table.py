"""KvTable against a plain Python model, and its error paths."""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvcoll as kv
from kvcoll import optimizers
from kvcoll.ids import hash64
from kvcoll.routing import BUCKETS, OwnerMap, owner_of, segment_sum, unique_partition
from kvcoll.exchange.kernels import gather_grad
from kvcoll.table import KvTable

DIM = 3
KEYS = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SMALL_KEYS = st.integers(min_value=-50, max_value=400)
key_lists = st.lists(st.one_of(SMALL_KEYS, KEYS), max_size=40)


def full_state(t: KvTable) -> dict:
    e = t.export()
    order = np.argsort(e["keys"], kind="stable")
    return {k: v[order] for k, v in e.items()}


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class TableVsDict(RuleBasedStateMachine):
    """Random insert/find/update/delete/clear/export-import; a dict is the model."""

    def __init__(self):
        super().__init__()
        self.t = KvTable(DIM, name="model", seed=5, initializer=("uniform", -1, 1),
                         optimizer=optimizers.SGD(0.1))
        self.model: dict[int, np.ndarray] = {}

    def teardown(self):
        self.t.close()

    @rule(keys=key_lists)
    def find_or_create(self, keys):
        k = np.array(keys, np.int64)
        rows = self.t.find_or_create(k, step=1)
        init = self.t.initial_values(k)
        for i, key in enumerate(keys):
            if key not in self.model:
                self.model[key] = init[i].copy()
            np.testing.assert_array_equal(rows[i], self.model[key])

    @rule(keys=key_lists)
    def find(self, keys):
        rows, found = self.t.find(np.array(keys, np.int64), return_found=True)
        for i, key in enumerate(keys):
            assert found[i] == (key in self.model)
            expect = self.model.get(key, np.zeros(DIM, np.float32))
            np.testing.assert_array_equal(rows[i], expect)

    @rule(keys=key_lists, data=st.data())
    def update(self, keys, data):
        vals = np.array(data.draw(st.lists(
            st.lists(st.floats(-1e6, 1e6, width=32), min_size=DIM, max_size=DIM),
            min_size=len(keys), max_size=len(keys))), np.float32).reshape(len(keys), DIM)
        self.t.update(np.array(keys, np.int64), vals)
        for i, key in enumerate(keys):  # the last duplicate wins
            self.model[key] = vals[i].copy()

    @rule(keys=key_lists)
    def delete(self, keys):
        n = self.t.delete(np.array(keys, np.int64))
        assert n == len({k for k in keys if k in self.model})
        for key in keys:
            self.model.pop(key, None)

    @precondition(lambda self: len(self.model) < 50)
    @rule(start=SMALL_KEYS, n=st.integers(100, 3000))
    def grow(self, start, n):
        """Many new keys at once: drives the table through several resizes."""
        k = np.arange(start * 1000, start * 1000 + n, dtype=np.int64)
        rows = self.t.find_or_create(k, step=2)
        for key, row in zip(k.tolist(), rows):
            self.model.setdefault(key, row.copy())

    @rule()
    def clear(self):
        self.t.clear()
        self.model.clear()

    @rule()
    def export_import_roundtrip(self):
        before = full_state(self.t)
        other = KvTable(DIM, name="model", seed=5, optimizer=optimizers.SGD(0.1))
        try:
            e = self.t.export()
            other.import_(e["keys"], e["values"], slots=e["slots"],
                          last_step=e["last_step"], counts=e["counts"])
            after = full_state(other)
            for k in ("keys", "values", "slots", "last_step", "counts"):
                np.testing.assert_array_equal(before[k], after[k])
        finally:
            other.close()

    @invariant()
    def same_size(self):
        assert len(self.t) == len(self.model)


TestTableVsDict = TableVsDict.TestCase
TestTableVsDict.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("init", ["zeros", ("constant", 0.25), ("uniform", -0.5, 0.5),
                                  ("normal", 0.0, 1.0), ("truncated_normal", 1.0, 0.5)])
def test_initial_values_do_not_depend_on_order_or_split(init):
    keys = np.random.default_rng(1).integers(-(2**62), 2**62, 5000)
    a = KvTable(8, name="emb", seed=11, initializer=init)
    b = KvTable(8, name="emb", seed=11, initializer=init)
    ra = a.find_or_create(keys)
    perm = np.random.default_rng(2).permutation(keys.size)
    for chunk in np.array_split(keys[perm], 7):  # another order, another batch split
        b.find_or_create(chunk)
    np.testing.assert_array_equal(b.find(keys), ra)
    np.testing.assert_array_equal(a.initial_values(keys), ra)
    other_table = KvTable(8, name="other", seed=11, initializer=init)
    other_seed = KvTable(8, name="emb", seed=12, initializer=init)
    if init not in ("zeros",) and init[0] != "constant":
        assert not np.array_equal(other_table.find_or_create(keys), ra)
        assert not np.array_equal(other_seed.find_or_create(keys), ra)
    for t in (a, b, other_table, other_seed):
        t.close()


def test_initializer_distributions():
    keys = np.arange(20000, dtype=np.int64)
    with KvTable(16, initializer=("uniform", -0.5, 0.5)) as t:
        v = t.find_or_create(keys)
        assert v.min() >= -0.5 and v.max() < 0.5 and abs(v.mean()) < 0.01
    with KvTable(16, initializer=("normal", 1.0, 2.0)) as t:
        v = t.find_or_create(keys)
        assert abs(v.mean() - 1.0) < 0.02 and abs(v.std() - 2.0) < 0.02
    with KvTable(16, initializer=("truncated_normal", 0.0, 1.0)) as t:
        v = t.find_or_create(keys)
        assert np.abs(v).max() <= 2.0 and 0.8 < v.std() < 0.9  # std of N(0,1) cut at 2
    with KvTable(4, initializer=("constant", 0.5)) as t:
        assert (t.find_or_create(keys[:10]) == 0.5).all()


def test_int32_ids_are_widened():
    with KvTable(2, initializer=("uniform", -1, 1)) as t:
        a = t.find_or_create(np.array([1, 2, 3], np.int32))
        np.testing.assert_array_equal(a, t.find(np.array([1, 2, 3], np.int64)))


def test_headers_track_steps_counts_and_dirty():
    with KvTable(2, optimizer=optimizers.SGD(1.0)) as t:
        t.find_or_create(np.array([5, 6]), step=3)
        t.apply_gradients(np.array([5, 5]), np.ones((2, 2), np.float32), step=7)
        e = full_state(t)
        assert e["keys"].tolist() == [5, 6]
        assert e["last_step"].tolist() == [7, 3]
        assert e["counts"].tolist() == [1, 0]  # duplicates summed, applied once
        np.testing.assert_array_equal(e["values"][0], [-2.0, -2.0])
        assert e["dirty"].tolist() == [True, True]  # created rows start dirty
        assert sorted(t.export(dirty_only=True, clear_dirty=True)["keys"].tolist()) == [5, 6]
        assert t.export(dirty_only=True)["keys"].size == 0
        t.apply_gradients(np.array([6]), np.ones((1, 2), np.float32), step=8)
        assert t.export(dirty_only=True)["keys"].tolist() == [6]


def test_missing_keys_on_apply_are_counted_or_created():
    with KvTable(2, optimizer=optimizers.SGD(1.0)) as t:
        assert t.apply_gradients(np.array([1, 2]), np.ones((2, 2), np.float32), step=1) == 2
        assert len(t) == 0
        assert t.apply_gradients(np.array([1]), np.ones((1, 2), np.float32), step=1,
                                 create_missing=True) == 0
        np.testing.assert_array_equal(t.find(np.array([1])), [[-1.0, -1.0]])


@pytest.mark.parametrize("admit", [0, 2])
def test_rows_by_reference_update_like_rows_by_key(admit):
    """find_or_create_ref + apply_gradients_ref leave a table exactly as find_or_create
    + apply_gradients do: duplicates, refs gone stale (delete), a lying ref, admission."""
    rng = np.random.default_rng(1)
    a, b = (KvTable(5, name="t", optimizer=optimizers.Adagrad(0.1), admit_min_count=admit,
                    initializer=("normal", 0.0, 0.1)) for _ in range(2))
    for step in range(1, 9):
        distinct = step % 2 == 1
        keys = rng.permutation(60)[:40] if distinct else rng.integers(0, 60, 40)
        grads = rng.normal(size=(40, 5)).astype(np.float32)
        rows_a = a.find_or_create(keys, step=step)
        out = np.empty((40, 5), np.float32)
        rows_b, refs = b.find_or_create_ref(keys, step=step, out=out)
        assert rows_b is out
        np.testing.assert_array_equal(rows_a, rows_b)
        assert refs.dtype == np.uint32 and ((refs == 0) == ~a.find(keys, return_found=True)[1]).all()
        if step == 3:
            a.delete(keys[:4])
            b.delete(keys[:4])
        if step == 5 and refs[0] and refs[1]:
            refs[0] = refs[1]
        ma = a.apply_gradients(keys, grads, step=step, create_missing=True)
        mb = b.apply_gradients_ref(keys, refs, grads, step=step, create_missing=True,
                                   distinct=distinct)
        assert ma == mb
    ea, eb = a.export(), b.export()
    for k in ea:
        np.testing.assert_array_equal(ea[k], eb[k])
    assert a.stats().dropped_grads == b.stats().dropped_grads
    assert admit == 0 or b.stats().dropped_grads > 0
    found = np.empty((3, 5), np.float32)
    assert a.find(np.array([999, keys[-1], 998]), out=found) is found
    np.testing.assert_array_equal(found[0], 0)
    a.close()
    b.close()


def test_stats_and_memory_overhead():
    with KvTable(16, optimizer=optimizers.Adagrad(0.1)) as t:
        t.find_or_create(np.arange(200_000, dtype=np.int64))
        s = t.stats()
        assert s.rows == 200_000 and s.dim == 16 and s.slot_floats == 16
        assert 0 < s.load_factor <= 1
        assert s.bytes >= s.rows * 4 * 32
        assert 0 < s.bytes_per_row_overhead <= 32  # the benchmark reports the exact figure


# -- bad input: a clear error, and the table unchanged ----------------------------------

@pytest.fixture
def filled():
    t = KvTable(4, name="user", optimizer=optimizers.Adagrad(0.1), initializer=("normal", 0, 1))
    t.find_or_create(np.arange(100, dtype=np.int64), step=1)
    t.apply_gradients(np.arange(0, 100, 3), np.ones((34, 4), np.float32), step=1)
    yield t
    t.close()


BAD_CALLS = [
    ("float ids", lambda t: t.find_or_create(np.array([1.0, 2.0])), kv.InvalidArgumentError,
     "ids must be int64 or int32, got float64"),
    ("uint64 ids", lambda t: t.find(np.array([1], np.uint64)), kv.InvalidArgumentError,
     "int64 or int32"),
    ("2-D ids", lambda t: t.find_or_create(np.zeros((2, 2), np.int64)), kv.InvalidArgumentError,
     "must be 1-D"),
    ("mixed string ids", lambda t: t.find_or_create(np.array(["a", 1], dtype=object)),
     kv.InvalidArgumentError, "str or bytes"),
    ("wrong dim", lambda t: t.update(np.array([1, 2]), np.zeros((2, 5), np.float32)),
     kv.DimensionError, r"shape \(2, 4\), got \(2, 5\)"),
    ("wrong row count", lambda t: t.update(np.array([1, 2]), np.zeros((3, 4), np.float32)),
     kv.InvalidArgumentError, "3 rows for 2 ids"),
    ("int values", lambda t: t.update(np.array([1]), np.zeros((1, 4), np.int64)),
     kv.InvalidArgumentError, "floating point"),
    ("nan gradient", lambda t: t.apply_gradients(
        np.array([1, 2, 500]), np.array([[0, 0, 0, 0], [1, np.nan, 1, 1], [1, 1, 1, 1]],
                                        np.float32), step=2), kv.NonFiniteError, "NaN|finite"),
    ("inf gradient", lambda t: t.apply_gradients(
        np.array([3]), np.array([[np.inf, 0, 0, 0]], np.float32), step=2),
     kv.NonFiniteError, "NaN|finite"),
    ("inf update", lambda t: t.update(np.array([3, 1000]), np.array(
        [[1, 1, 1, 1], [0, 0, -np.inf, 0]], np.float32)), kv.NonFiniteError, "NaN|finite"),
    ("nan import", lambda t: t.import_(np.array([4]), np.full((1, 4), np.nan, np.float32)),
     kv.NonFiniteError, "NaN|finite"),
    ("gradient dim", lambda t: t.apply_gradients(np.array([1]), np.zeros((1, 3), np.float32),
                                                  step=1), kv.DimensionError, "dim is 4"),
    ("step 0", lambda t: t.apply_gradients(np.array([1]), np.zeros((1, 4), np.float32), step=0),
     kv.InvalidArgumentError, "step must be an integer >= 1"),
    ("slots width", lambda t: t.import_(np.array([1]), np.zeros((1, 4), np.float32),
                                        slots=np.zeros((1, 3), np.float32)),
     kv.DimensionError, "slots"),
    ("bad default", lambda t: t.find(np.array([1]), default=np.zeros(3)), kv.DimensionError,
     "default"),
    ("out shape", lambda t: t.find(np.array([1, 2]), out=np.zeros((2, 3), np.float32)),
     kv.InvalidArgumentError, "out must be"),
    ("out dtype", lambda t: t.find_or_create_ref(np.array([1]), out=np.zeros((1, 4))),
     kv.InvalidArgumentError, "out must be"),
    ("refs length", lambda t: t.apply_gradients_ref(np.array([1, 2]), np.ones(1, np.uint32),
                                                    np.zeros((2, 4), np.float32), step=1),
     kv.InvalidArgumentError, "refs must be 2 integers"),
    ("nan by ref", lambda t: t.apply_gradients_ref(
        np.array([1, 2]), np.array([1, 2], np.uint32),
        np.array([[0, 0, 0, 0], [np.nan, 0, 0, 0]], np.float32), step=1),
     kv.NonFiniteError, "NaN|finite"),
]


@pytest.mark.parametrize("what,call,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_rejected_and_changes_nothing(filled, what, call, exc, match):
    before = full_state(filled)
    with pytest.raises(exc, match=match):
        call(filled)
    assert_same_state(before, full_state(filled))


def test_closed_table_raises():
    t = KvTable(2, name="gone")
    t.close()
    t.close()  # idempotent
    with pytest.raises(kv.ClosedError, match="table 'gone' is closed"):
        t.find(np.array([1]))
    with pytest.raises(kv.ClosedError):
        len(t)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dim=0), "dim must be an integer in"),
    (dict(dim=70000), "dim must be an integer in"),
    (dict(dim=2.5), "dim must be an integer"),
    (dict(dim=4, initializer=("uniform", 1, 0)), "low < high"),
    (dict(dim=4, initializer="glorot"), "unknown"),
    (dict(dim=4, initializer=("normal", 0.0)), "takes 2 parameter"),
    (dict(dim=4, optimizer="adam"), "row optimizer"),
    (dict(dim=4, seed=-1), "seed"),
])
def test_bad_table_arguments(kwargs, match):
    with pytest.raises(kv.InvalidArgumentError, match=match):
        KvTable(**kwargs)


def test_large_dim_works():
    with KvTable(1024, initializer=("uniform", -1, 1)) as t:
        r = t.find_or_create(np.arange(300, dtype=np.int64))
        assert r.shape == (300, 1024)
        t.update(np.array([7]), np.ones((1, 1024), np.float32))
        assert (t.find(np.array([7])) == 1).all()


def test_concurrent_find_and_update_keep_rows_whole():
    """A reader never sees a half-written row while a writer assigns whole rows."""
    with KvTable(64) as t:
        keys = np.arange(1000, dtype=np.int64)
        t.update(keys, np.zeros((1000, 64), np.float32))
        stop = threading.Event()
        torn = []

        def writer():
            v = 1.0
            while not stop.is_set():
                t.update(keys, np.full((1000, 64), v, np.float32))
                t.find_or_create(np.arange(10**6 + v * 1000, 10**6 + v * 1000 + 50,
                                           dtype=np.int64))
                v += 1

        th = threading.Thread(target=writer)
        th.start()
        try:
            for _ in range(300):
                rows = t.find(keys)
                torn.append(int((rows.min(axis=1) != rows.max(axis=1)).sum()))
        finally:
            stop.set()
            th.join()
        assert sum(torn) == 0


# -- routing kernels -----------------------------------------------------------------------

def test_unique_partition_matches_numpy():
    rng = np.random.default_rng(0)
    keys = rng.integers(-1000, 1000, 5000)
    for world in (1, 2, 3, 7):
        uniq, inverse, counts = unique_partition(keys, world)
        np.testing.assert_array_equal(uniq[inverse], keys)
        assert sorted(uniq.tolist()) == np.unique(keys).tolist()
        owners = owner_of(uniq, world)
        assert (np.diff(owners) >= 0).all()  # grouped by owner
        assert counts.tolist() == np.bincount(owners, minlength=world).tolist()
        # first-appearance order inside each owner group
        first = {int(k): i for i, k in reversed(list(enumerate(keys)))}
        for r in range(world):
            grp = uniq[owners == r]
            assert [first[int(k)] for k in grp] == sorted(first[int(k)] for k in grp)


def test_owner_and_hash_are_stable_and_balanced():
    keys = np.arange(100_000, dtype=np.int64)
    h = hash64(keys)
    assert h.dtype == np.uint64 and np.unique(h).size == keys.size
    # the owner is the map's rank of the model bucket (hash bits 40..55); a table's own
    # buckets use the low 32 bits
    bucket = ((h >> np.uint64(40)) % np.uint64(BUCKETS)).astype(np.int64)
    np.testing.assert_array_equal(owner_of(keys, 3), OwnerMap.even(3).array[bucket])
    counts = np.bincount(owner_of(keys, 4), minlength=4)
    assert counts.min() > 0.97 * keys.size / 4
    assert owner_of(np.array([], np.int64), 2).size == 0


def test_segment_sum():
    keys = np.array([4, 1, 4, 9, 1, 4])
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    u, s = segment_sum(keys, rows)
    assert u.tolist() == [4, 1, 9]
    np.testing.assert_array_equal(s, [[0 + 4 + 10, 1 + 5 + 11], [2 + 8, 3 + 9], [6, 7]])


@pytest.mark.parametrize("dim", [1, 8, 9, 17, 40])
def test_gather_grad_sums_per_row_like_numpy(dim):
    rng = np.random.default_rng(dim)
    idx = rng.integers(0, 97, 3000)  # rows 97.. 99 never gathered
    vals = rng.standard_normal((3000, dim)).astype(np.float32)
    out = gather_grad(vals, idx, 100)
    want = np.zeros((100, dim), np.float32)
    np.add.at(want, idx, vals)  # unbuffered, in order of i: the same sums
    np.testing.assert_array_equal(out, want)
    assert out.ctypes.data % 64 == 0 and not out[97:].any()
    assert gather_grad(np.zeros((0, dim), np.float32), np.zeros(0, np.int64), 3).shape == (3, dim)


def test_gather_grad_refuses_bad_input():
    vals = np.ones((3, 4), np.float32)
    with pytest.raises(kv.InvalidArgumentError, match=r"outside \[0, 5\)"):
        gather_grad(vals, np.array([0, 5, 1]), 5)
    with pytest.raises(kv.InvalidArgumentError, match="values must be"):
        gather_grad(vals, np.array([0, 1]), 5)
