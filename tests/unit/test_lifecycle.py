"""Feature lifecycle: admission, eviction, string keys, memory and checkpoints (one process).

The table-level behaviour is checked against small Python models of the documented
policies; the memory test streams 50M distinct ids through a 2M-row budget.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import kvcoll as kv
from kvcoll import optimizers
from kvcoll.checkpoint import Checkpointer, read_shard
from kvcoll.comm import Comm
from kvcoll.ids import hash_strings
from kvcoll.routing import owner_of
from kvcoll.table import KvTable

INIT = ("uniform", -1.0, 1.0)


# -- admission ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["exact", "bloom"])
def test_admission_after_k_sightings(mode):
    k = 4
    t = KvTable(3, name="adm", initializer=INIT, optimizer=optimizers.SGD(0.5),
                admit_min_count=k, admit=mode, bloom_counters=1 << 16)
    ids = np.array([11, 22, 11])  # 11 twice in one call: one sighting
    g = np.ones((3, 3), np.float32)
    for step in range(1, k):  # seen k - 1 times: no row, the default vector
        rows, has = t.find_or_create(ids, step=step, return_has_row=True)
        assert not has.any() and not rows.any()
        # the gradients of unadmitted keys are dropped, as BSP's push does it
        assert t.apply_gradients(ids, g, step=step, create_missing=True) == 2
        assert len(t) == 0 and not t.find(ids, return_found=True)[1].any()
    s = t.stats()
    assert (s.rejected, s.dropped_grads, s.admitted) == (3 * (k - 1), 2 * (k - 1), 0)
    assert s.pending == (2 if mode == "exact" else 0) and s.admission_bytes > 0
    rows, has = t.find_or_create(ids, step=k, return_has_row=True)  # the k-th sighting
    assert has.all() and len(t) == 2
    init = t.initial_values(ids)
    np.testing.assert_array_equal(rows, init)  # fresh: no dropped gradient reached it
    t.apply_gradients(ids, g, step=k, create_missing=True)
    np.testing.assert_allclose(t.find(ids), init - 0.5 * np.array([[2], [1], [2]]) * g)
    assert t.stats().admitted == 2 and t.stats().pending == 0


def test_admission_off_and_settings():
    t = KvTable(2, admit_min_count=1)
    assert t.find_or_create(np.array([5]), return_has_row=True)[1].all()
    with pytest.raises(kv.InvalidArgumentError, match="admit"):
        KvTable(2, admit="sometimes")
    with pytest.raises(kv.InvalidArgumentError, match="admit_min_count"):
        KvTable(2, admit="bloom", admit_min_count=16)
    with pytest.raises(kv.InvalidArgumentError, match="evict_policy"):
        KvTable(2, evict_policy="fifo")


# -- eviction ----------------------------------------------------------------------------

def _model_evict(keys, steps, counts, min_last_step, max_rows, policy):
    """The documented policy in plain Python: the keys that stay."""
    rows = [(s, c, k) if policy == "lru" else (c, s, k)
            for k, s, c in zip(keys.tolist(), steps.tolist(), counts.tolist())
            if s >= min_last_step]
    rows.sort()
    if max_rows is not None and len(rows) > max_rows:
        rows = rows[len(rows) - max_rows:]
    return {r[2] for r in rows}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(4))
def test_evict_removes_exactly_the_policy_rows(policy, seed):
    rng = np.random.default_rng(seed)
    n = 3000
    keys = rng.choice(2**62, n, replace=False).astype(np.int64)
    steps = rng.integers(0, [5, 100, 1 << 20, 2**32 - 1][seed], n).astype(np.uint32)
    counts = rng.integers(0, 4 if seed == 0 else 1000, n).astype(np.uint32)
    t = KvTable(4, name="ev", initializer=INIT, evict_policy=policy)
    t.import_(keys, np.zeros((n, 4), np.float32), last_step=steps, counts=counts)
    min_last_step = int(np.sort(steps)[n // 5])
    budget = int(rng.integers(0, n))
    want = _model_evict(keys, steps, counts, min_last_step, budget, policy)
    assert t.evict(min_last_step=min_last_step, max_rows=budget) == n - len(want)
    assert set(t.export()["keys"].tolist()) == want
    assert t.stats().evicted == n - len(want)


def test_ttl_eviction_and_keys_come_back_fresh():
    t = KvTable(4, name="ttl", initializer=INIT, optimizer=optimizers.SGD(1.0),
                evict_after_steps=10)
    old, new = np.arange(100, dtype=np.int64), np.arange(100, 150, dtype=np.int64)
    t.find_or_create(old, step=1)
    t.apply_gradients(old, np.ones((100, 4), np.float32), step=1)  # trained: not initial
    t.find_or_create(new, step=8)
    assert t.evict(10) == 0           # step 1 is within the last 10 steps of step 10
    assert t.evict(11) == 100         # not touched in steps 2..11: gone
    assert set(t.export()["keys"].tolist()) == set(new.tolist())
    rows, has = t.find(old, return_found=True)
    assert not has.any()
    np.testing.assert_array_equal(t.find_or_create(old, step=12), t.initial_values(old))


def test_budget_eviction_lru_order_and_refill():
    t = KvTable(2, name="budget", max_rows=50)
    for step in range(1, 11):  # keys 10*(step-1) .. touched at their step
        t.find_or_create(np.arange(10 * (step - 1), 10 * step, dtype=np.int64), step=step)
    t.find_or_create(np.arange(5, dtype=np.int64), step=11)  # 0..4 recently used again
    assert t.evict(11) == 50
    assert set(t.export()["keys"].tolist()) == set(range(5)) | set(range(55, 100))
    assert len(t) == 50 and t.stats().bytes_per_row_overhead > 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_flat_under_a_stream_of_50m_ids():
    """50M distinct ids in batches of 1M through a 2M-row budget: after warm-up (10M
    ids) the resident memory stays within 10 %."""
    t = KvTable(8, name="stream", max_rows=2_000_000, initializer=("normal", 0.0, 0.01))
    batch, total, warm = 1_000_000, 50_000_000, 10_000_000
    rss_warm = None
    peak = 0
    for i, start in enumerate(range(0, total, batch)):
        ids = np.arange(start, start + batch, dtype=np.int64) + (1 << 40)  # distinct
        t.find_or_create(ids, step=i + 1)
        t.evict(i + 1)
        assert len(t) <= 2_000_000
        if start + batch == warm:
            rss_warm = _rss_bytes()
        elif rss_warm is not None:
            peak = max(peak, _rss_bytes())
    s = t.stats()
    assert s.evicted == total - 2_000_000 and s.admitted == total
    assert peak <= rss_warm * 1.10, (rss_warm, peak)
    t.close()


# -- checkpoints -------------------------------------------------------------------------

def test_incremental_checkpoint_records_evictions(tmp_path):
    t = KvTable(4, name="ck", initializer=INIT, max_rows=None, evict_after_steps=5)
    ck = Checkpointer({"ck": t}, Comm.local())
    t.find_or_create(np.arange(100, dtype=np.int64), step=1)
    ck.save(tmp_path, 1)
    t.find_or_create(np.arange(50, 120, dtype=np.int64), step=7)
    assert t.evict(7) == 50                                # 0..49: evicted
    t.find_or_create(np.arange(10, dtype=np.int64), step=8)  # 0..9 come back
    t.evict(8, max_rows=None)
    info = ck.save(tmp_path, 8, incremental=True)
    assert info.kind == "delta"
    shard = read_shard(next(p for p in (tmp_path / info.name).iterdir()
                            if p.suffix == ".kvs"))
    assert set(shard["removed"].tolist()) == set(range(50))
    want = t.export()
    t2 = KvTable(4, name="ck", initializer=INIT)
    Checkpointer({"ck": t2}, Comm.local()).restore(tmp_path)
    got = t2.export()
    assert set(got["keys"].tolist()) == set(range(10)) | set(range(50, 120))
    order_w, order_g = np.argsort(want["keys"]), np.argsort(got["keys"])
    np.testing.assert_array_equal(want["keys"][order_w], got["keys"][order_g])
    np.testing.assert_array_equal(want["values"][order_w], got["values"][order_g])
    # after the restore, removals are logged relative to it
    assert t2.evict(min_last_step=8) == 70 and t2.stats().removed_logged == 70


# -- string keys -------------------------------------------------------------------------

def test_string_hash_xxh64_is_seed_0():
    got = hash_strings(["", "a", "abc", b"68fd1e64"], "xxh64").view(np.uint64)
    assert got.tolist() == [0xEF46DB3751D8E999, 0xD24EC4F1A98C6E5B, 0x44BC2CF5AD770999,
                            0x5D3CCD85C9C22FE4]
    u = np.array(["68fd1e64", "ümlaut", "x" * 100])
    np.testing.assert_array_equal(hash_strings(u), hash_strings(np.char.encode(u, "utf-8")))
    np.testing.assert_array_equal(hash_strings(u), hash_strings(u.astype(object)))
    assert hash_strings(np.array([["a", "b"]])).shape == (1, 2)


def test_equal_strings_equal_rows_across_processes_and_ranks():
    """Another process (another PYTHONHASHSEED) hashes the same strings to the same keys;
    the same string finds the same row, and every rank routes it to the same owner."""
    words = ["user_%d" % i for i in range(1000)] + ["05db9164", "68fd1e64"]
    code = ("import sys, numpy as np; from kvcoll.ids import hash_strings; "
            "sys.stdout.write(' '.join(map(str, hash_strings(sys.argv[1:]).tolist())))")
    runs = [subprocess.run([sys.executable, "-c", code, *words], check=True,
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")]
    assert runs[0] == runs[1] == " ".join(map(str, hash_strings(words).tolist()))
    t = KvTable(4, name="users", initializer=INIT)
    rows = t.find_or_create(np.array(words, dtype=object), step=1)
    np.testing.assert_array_equal(t.find(np.array(words[::-1]))[::-1], rows)
    np.testing.assert_array_equal(rows, t.initial_values(hash_strings(words)))
    owners = owner_of(hash_strings(words), 4)
    np.testing.assert_array_equal(owners, owner_of(hash_strings(list(words)), 4))
    assert len(np.unique(hash_strings(words))) == len(words)


@pytest.mark.parametrize("admit", ["exact", "bloom"])
def test_admission_state_moves_to_another_table(admit):
    """export_admission / import_admission carry the admission counts, so a restored
    table admits a key exactly when the original would (the Bloom filter, merged over
    shards, never later)."""
    a = KvTable(2, name="a", admit_min_count=3, admit=admit)
    b = KvTable(2, name="a", admit_min_count=3, admit=admit)
    for step in (1, 2):
        a.find_or_create(np.array([5, 6, 7]), step=step)
    state = a.export_admission()
    if admit == "exact":
        assert sorted(state["keys"].tolist()) == [5, 6, 7] and (state["counts"] == 2).all()
        assert state["bloom"] is None
    else:
        assert state["keys"].size == 0 and state["bloom"].size == 2 ** 21
    b.import_admission(state, merge=admit == "bloom")
    _, has = b.find_or_create(np.array([5, 6, 7, 8]), step=3, return_has_row=True)
    assert has.tolist() == [True, True, True, False]
    fresh = KvTable(2, name="a", admit_min_count=3, admit=admit)
    _, has = fresh.find_or_create(np.array([5]), step=3, return_has_row=True)
    assert not has[0]                                  # without the state: not yet
    other = KvTable(2, name="a")                       # no admission counting
    if admit == "exact":
        with pytest.raises(kv.InvalidArgumentError, match="admission state"):
            other.import_admission(state)
    for t in (a, b, fresh, other):
        t.close()
