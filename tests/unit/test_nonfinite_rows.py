"""Updates that would make a row or an optimizer slot NaN/Inf are refused (#29 defect 12).

Huge but finite gradients (1e30: Adagrad's g^2, Adam's second moment and FTRL's
accumulator overflow float32; SGD past FLT_MAX) used to leave rows or slots that are not
finite, and every later checkpoint then refused to restore. Here, in one process:

- the table refuses such an update whole, on every apply path, and names the table and
  the key; nothing changes (values, slots, last step, count, dirty bit, rows);
- the exchange kernels prepare a push without changing any table, and name the first
  (table, key) that is not finite; a refused push changes no table, not even those that
  were fine;
- a one-rank BSP exchange turns it into the step's outcome (FAILED, the error), which
  an abandon gives up with every table as before the step;
- a checkpoint save never writes rows it could not restore: it fails on every rank
  naming the table and the key, and the previous checkpoint stays the latest.
The multi-rank cases (every rank refuses alike; kv.Trainer and model.fit; SSP's owner)
are in tests/mpi/test_nonfinite_rows.py.
"""

import os

import numpy as np
import pytest

import kvcoll as kv
import kvcoll.checkpoint as ck
from kvcoll import optimizers
from kvcoll.comm import Comm
from kvcoll.exchange import OK, Agreement, BspExchange
from kvcoll.exchange.kernels import TableSet
from kvcoll.routing import OwnerMap
from kvcoll.table import KvTable, first_nonfinite_row

DIM = 4
KEYS = np.arange(100, 140, dtype=np.int64)

OPTIMIZERS = {
    "sgd": lambda: optimizers.SGD(10.0),
    "adagrad": lambda: optimizers.Adagrad(0.1),
    "adam": lambda: optimizers.Adam(0.01),
    "ftrl": lambda: optimizers.Ftrl(0.1),
}


def table(opt="adagrad", name="user"):
    t = KvTable(DIM, name=name, seed=3, initializer=("uniform", -0.1, 0.1),
                optimizer=OPTIMIZERS[opt]())
    t.find_or_create(KEYS, step=1)
    t.apply_gradients(KEYS, np.zeros((KEYS.size, DIM), np.float32), step=1)  # trained once
    if opt == "sgd":  # a row near FLT_MAX: w - 10 * (-1e38) overflows
        t.update(KEYS[7:8], np.full((1, DIM), 3e38, np.float32))
    return t


def huge_grads(opt="adagrad", bad=7):
    g = np.full((KEYS.size, DIM), 0.01, np.float32)
    g[bad, 2] = -1e38 if opt == "sgd" else 1e30
    return g


def state(t):
    e = t.export()
    order = np.argsort(e["keys"])
    return {k: v[order] for k, v in e.items()} | {"stats": t.stats()}


def assert_same(a, b, looked_up=()):
    """Tables a and b hold the same rows, slots and headers; the rows of `looked_up`
    may differ in last_step alone (a pull stamps the rows it looks up, as it does for
    a step given up for a NaN gradient, and so the index may have grown and the
    admission counter counted the rows it created and forgot)."""
    if len(looked_up):
        assert (a["stats"].rows, a["stats"].dropped_grads) == \
            (b["stats"].rows, b["stats"].dropped_grads)
    else:
        assert a["stats"] == b["stats"]
    for k in ("keys", "values", "slots", "counts", "dirty"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    other = ~np.isin(a["keys"], np.asarray(looked_up, np.int64))
    np.testing.assert_array_equal(a["last_step"][other], b["last_step"][other])


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_table_refuses_an_update_that_is_not_finite_and_names_the_key(opt):
    t = table(opt)
    before = state(t)
    g = huge_grads(opt)
    match = rf"table 'user': key {KEYS[7]}: step 2: the update would make its row"
    with pytest.raises(kv.NonFiniteError, match=match):
        t.apply_gradients(KEYS, g, step=2)
    with pytest.raises(kv.NonFiniteError, match=match):
        t.apply_gradients(KEYS, g, step=2, create_missing=True)
    _, refs = t.find_or_create_ref(KEYS, step=1)
    after_lookup = state(t)  # find_or_create_ref stamped step 1 again: nothing else
    for distinct in (False, True):
        with pytest.raises(kv.NonFiniteError, match=match):
            t.apply_gradients_ref(KEYS, refs, g, step=2, distinct=distinct)
    assert_same(after_lookup, before)
    assert_same(state(t), before)
    # the rest of the batch alone is applied, and every row and slot stays finite
    g[7] = 0.01
    t.apply_gradients(KEYS, g, step=2)
    e = t.export()
    assert np.isfinite(e["values"]).all() and np.isfinite(e["slots"]).all()
    assert (e["counts"] == 2).all() and e["dirty"].all()
    t.close()


def test_a_new_key_whose_first_update_is_not_finite_gets_no_row():
    t = table()
    n = len(t)
    g = np.zeros((1, DIM), np.float32)
    g[0, 0] = 1e30
    with pytest.raises(kv.NonFiniteError, match="table 'user': key 999: step 3"):
        t.apply_gradients([999], g, step=3, create_missing=True)
    assert len(t) == n and not t.find([999], return_found=True)[1][0]
    t.close()


def test_a_gradient_sum_that_overflows_is_named_as_the_gradient():
    t = table()
    before = state(t)
    g = np.zeros((2, DIM), np.float32)
    g[:, 1] = 3e38
    with pytest.raises(kv.NonFiniteError,
                       match=rf"key {KEYS[3]}: step 2: its gradients summed .* overflow"):
        t.apply_gradients([KEYS[3], KEYS[3]], g, step=2)
    g[1, 1] = np.nan
    with pytest.raises(kv.NonFiniteError, match=rf"key {KEYS[3]}: step 2: its gradient is "):
        t.apply_gradients([KEYS[3], KEYS[3]], g, step=2)
    assert_same(state(t), before)
    t.close()


def served(tset, ids, step=1):
    """A one-rank pull's serve of `ids` (table -> int64 array): the state a push needs."""
    send, counts, *_ = tset.plan([ids[t.name] for t in tset.tables], OwnerMap.even(1))
    reply = np.empty(int((counts * tset.dims).sum()), np.float32)
    return tset.serve(send, counts, step, True, reply), counts


def test_the_exchange_prepares_without_changing_and_refuses_all_tables_alike():
    a, b = table("adagrad", "a"), table("adam", "b")
    tset = TableSet([a, b])
    ids = {"a": KEYS[:10], "b": KEYS[5:25]}
    st, counts = served(tset, ids, step=2)
    before = [state(a), state(b)]
    ukeys, ustart = st[2], st[4]
    grads = np.full(int((counts * tset.dims).sum()), 0.01, np.float32)
    # table b's 4th distinct id: a huge gradient (table a's would be applied fine)
    bad_key = int(ukeys[ustart[1] + 3])
    grads[10 * DIM + 3 * DIM + 1] = 1e30
    with pytest.raises(kv.NonFiniteError,
                       match=rf"table 'b': key {bad_key}: step 2: the update would make its row "
                             r"or its Adam slots NaN/Inf"):
        tset.prepare(st, grads, 2)
    with pytest.raises(kv.NonFiniteError, match=rf"table 'b': key {bad_key}"):
        tset.apply(st, grads, 2)
    assert_same(state(a), before[0])
    assert_same(state(b), before[1])
    # NaN as received: named too
    grads[10 * DIM + 3 * DIM + 1] = np.nan
    with pytest.raises(kv.NonFiniteError, match=rf"key {bad_key}: step 2: its gradient"):
        tset.prepare(st, grads, 2)
    grads[10 * DIM + 3 * DIM + 1] = 0.01
    # a good push: prepare changes nothing; commit writes what kv_table_apply does
    ref = [KvTable(DIM, name=n, seed=3, initializer=("uniform", -0.1, 0.1),
                   optimizer=OPTIMIZERS[o]()) for n, o in (("a", "adagrad"), ("b", "adam"))]
    for r, t in zip(ref, (a, b)):
        e = t.export()
        r.import_(e["keys"], e["values"], slots=e["slots"], last_step=e["last_step"],
                  counts=e["counts"])
    prepared = tset.prepare(st, grads, 2)
    assert_same(state(a), before[0])
    assert_same(state(b), before[1])
    assert (tset.commit(prepared) == 0).all()
    at = 0
    for r, t, name in zip(ref, (a, b), "ab"):
        n = ids[name].size
        r.apply_gradients(ids[name], grads[at:at + n * DIM].reshape(n, DIM), step=2)
        at += n * DIM
        got, want = state(t), state(r)
        for k in ("keys", "values", "slots", "counts"):
            np.testing.assert_array_equal(got[k], want[k], err_msg=(name, k))
    for t in [a, b, *ref]:
        t.close()


def test_a_one_rank_bsp_step_is_refused_and_abandoned_as_before_it():
    comm = Comm.local()
    tables = {"a": table("adagrad", "a"), "b": table("sgd", "b")}
    ex = BspExchange(comm, tables)
    before = {n: state(t) for n, t in tables.items()}
    ids = {"a": np.array([KEYS[0], 7777, KEYS[2]]), "b": np.array([KEYS[7], KEYS[8]])}
    agreement = Agreement(3)
    pull = ex.pull(ids, agreement)
    assert len(tables["a"]) == KEYS.size + 1  # the pull created 7777
    g = {n: np.full((p.uniq.size, DIM), 0.01, np.float32) for n, p in pull.items()}
    g["b"][list(pull["b"].uniq).index(KEYS[7]), 0] = -1e38
    agreement.report(OK)
    pushed = ex.push(pull, g, None, np.zeros(1, np.float32), agreement,
                     lr={"a": 0.5, "b": 2.0})
    pushed.reduced()
    assert agreement.outcome_failed == [0]
    assert isinstance(agreement.outcome_error, kv.NonFiniteError)
    assert f"table 'b': key {KEYS[7]}: step 1" in str(agreement.outcome_error)
    ex.abandon(pushed)
    for n, t in tables.items():  # 7777 is gone, the learning rates are back
        assert_same(state(t), before[n], ids[n])
    assert tables["a"].learning_rate == pytest.approx(0.1)
    assert tables["b"].learning_rate == pytest.approx(10.0)
    assert ex.step == 0
    # without an agreement of the caller's, commit() gives the step up and raises
    pull = ex.pull(ids)
    with pytest.raises(kv.NonFiniteError, match=f"table 'b': key {KEYS[7]}: step 1"):
        ex.push(pull, g).commit()
    for n, t in tables.items():
        assert_same(state(t), before[n], ids[n])
    # and a good step goes through
    g["b"][:] = 0.01
    ex.push(ex.pull(ids), g).commit()
    assert tables["b"].find(KEYS[8:9])[0, 0] != before["b"]["values"][8, 0]
    for t in tables.values():
        t.close()


def test_first_nonfinite_row():
    v = np.zeros((10_000, 3), np.float32)
    assert first_nonfinite_row(v) == -1
    v[6001, 2] = np.inf
    v[9000, 0] = np.nan
    assert first_nonfinite_row(v) == 6001
    assert first_nonfinite_row(np.zeros((0, 3), np.float32)) == -1
    assert first_nonfinite_row(np.zeros((5, 0), np.float32)) == -1


@pytest.mark.parametrize("column", ["values", "slots"])
def test_a_save_never_writes_rows_it_could_not_restore(tmp_path, monkeypatch, column):
    comm = Comm.local()
    t = table()
    c = ck.Checkpointer({"user": t}, comm)
    first = c.save(tmp_path, 1)
    t.apply_gradients(KEYS[:5], np.ones((5, DIM), np.float32), step=2)

    # kvcoll no longer makes such rows; a row from elsewhere (an older kvcoll, a bug)
    # is what the save must still catch: one is slipped into what the save reads
    real = ck._rows_to_save

    def poisoned(table, delta):
        rows = real(table, delta)
        rows[column][3, 0] = np.inf
        return rows

    monkeypatch.setattr(ck, "_rows_to_save", poisoned)
    key = int(t.export(dirty_only=True)["keys"][3])  # the delta's 4th row
    what = "embedding" if column == "values" else "optimizer slots"
    with pytest.raises(kv.CheckpointError,
                       match=rf"table 'user': key {key} on rank 0 has a NaN/Inf in its {what}"
                             r".*could not be restored.*previous checkpoint is intact"):
        c.save(tmp_path, 2, incremental=True)
    assert ck.latest(tmp_path) == first.name
    assert sorted(os.listdir(tmp_path)) == sorted(["latest", first.name])
    monkeypatch.setattr(ck, "_rows_to_save", real)
    # the next save is a full one (the failed save had cleared the dirty bits), and it
    # restores to the table as it is
    info = c.save(tmp_path, 2, incremental=True)
    assert info.kind == "full" and ck.latest(tmp_path) == info.name
    fresh = KvTable(DIM, name="user", seed=3, initializer=("uniform", -0.1, 0.1),
                    optimizer=OPTIMIZERS["adagrad"]())
    ck.Checkpointer({"user": fresh}, comm).restore(tmp_path)
    got, want = state(fresh), state(t)
    for k in ("keys", "values", "slots", "counts"):
        np.testing.assert_array_equal(got[k], want[k])
    for x in (t, fresh):
        x.close()
