"""SSP and ASP at any world size: the exchange alone, then through the Keras Trainer.

- no update is lost: SGD, a fixed gradient per id and per dense slice, uneven step
  counts; the final rows and dense vector equal the initial ones minus every push;
- SSP's bound: with the last rank held at its first step, every other rank's lead
  reaches exactly S and never more, checked against the other ranks' recorded step times, and the staleness
  observed stays <= S (S = 0: BSP's schedule);
- ASP: a rank held at its first step holds nobody back: the others run all their steps;
- a training thread waiting for its replies serves its peers' requests itself;
- the service thread idles in C and is rung out of it (by its peers on this machine
  after their requests, by its own training thread after its push);
- (no sleep decides an outcome: a rank is held back by waiting for the others' messages);
- the Trainer in SSP/ASP: uneven data and a rank finishing early end without a hang and
  with the same final dense model on every rank; unsupported dense optimizers are
  refused with a clear error.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.exchange import SspExchange  # noqa: E402
from kvcoll.routing import BUCKETS, OwnerMap, owner_of  # noqa: E402

DIMS = {"a": 3, "b": 2}
LR = 0.5
DENSE = 10


def make_tables():
    return {n: kv.KvTable(d, name=n, seed=4, initializer=("uniform", -1, 1),
                          optimizer=kv.optimizers.SGD(LR)) for n, d in DIMS.items()}


def ids_of(rank, step):
    g = np.random.default_rng([5, rank, step])
    return {"a": g.integers(0, 50, 20).astype(np.int64),
            "b": g.integers(-10, 10, 7).astype(np.int64)}


def grad_of(ids, dim):
    """A fixed gradient per id."""
    return (np.asarray(ids, np.float32)[:, None] * 0.01 + np.arange(dim, dtype=np.float32)[None])


def steps_of(rank):
    return 4 + 2 * rank


def drive(ex, rank, steps, dense_init=None, after_pull=None):
    """Run `steps` steps; after_pull(step), if given, runs between a step's pull and its
    push (where a test holds a rank back, or says how far it got)."""
    ex.start_dense(dense_init if dense_init is not None else np.zeros(DENSE, np.float32))
    for step in range(1, steps + 1):
        ids = ids_of(rank, step)
        pulled = ex.pull(ids)
        assert pulled.step == ex.step == step
        assert pulled.dense is None or pulled.dense.shape == (DENSE,)
        if after_pull is not None:
            after_pull(step)
        grads = {n: grad_of(p.uniq, DIMS[n]) for n, p in pulled.items()}
        ex.push(pulled, grads, np.full(DENSE, rank + 1.0, np.float32))
    return ex.finish()


@pytest.mark.parametrize("staleness,owners", [(0, "even"), (2, "even"), (None, "even"),
                                              (2, "random")],
                         ids=["ssp0", "ssp2", "asp", "ssp2-random-map"])
def test_no_update_is_lost(comm, staleness, owners):
    world, rank = comm.size, comm.rank
    tables = make_tables()
    dense0 = np.linspace(-1, 1, DENSE).astype(np.float32)
    owners = OwnerMap.even(world) if owners == "even" else \
        OwnerMap(np.random.default_rng(11).integers(0, world, BUCKETS), world)
    ex = SspExchange(comm, tables, staleness, dense_size=DENSE,
                     dense_optimizer=kv.optimizers.SGD(LR), owners=owners)
    assert ex.owners is owners
    top = drive(ex, rank, steps_of(rank), dense_init=dense0)
    assert top == max(steps_of(r) for r in range(world))
    # expected: initial value minus lr * gradient, once per (rank, step) that pulled it
    for n, t in tables.items():
        pushes = {}
        for r in range(world):
            for s in range(1, steps_of(r) + 1):
                for k in np.unique(ids_of(r, s)[n]):
                    pushes[int(k)] = pushes.get(int(k), 0) + 1
        mine = np.array(sorted(k for k in pushes if owner_of(np.array([k]), owners)[0] == rank),
                        np.int64)
        times = np.array([pushes[int(k)] for k in mine], np.float32)
        want = t.initial_values(mine) - LR * grad_of(mine, DIMS[n]) * times[:, None]
        np.testing.assert_allclose(t.find(mine), want, rtol=1e-5, atol=1e-5, err_msg=n)
        assert len(t) == mine.size
    total = sum((r + 1.0) * steps_of(r) for r in range(world))
    np.testing.assert_allclose(ex.dense(), dense0 - LR * total, rtol=1e-6, atol=1e-5)
    ex.close()
    for t in tables.values():
        t.close()


def test_a_waiting_worker_serves_its_peers(comm):
    """While a training thread waits for its pull's replies it serves the requests that
    have arrived (the service thread's work, under the same lock): with every service
    thread kept from serving, the ranks' training threads alone answer each other's
    pulls and apply each other's pushes, and no update is lost."""
    import threading

    world, rank = comm.size, comm.rank
    tables = make_tables()
    dense0 = np.linspace(-1, 1, DENSE).astype(np.float32)
    ex = SspExchange(comm, tables, None, dense_size=DENSE,
                     dense_optimizer=kv.optimizers.SGD(LR))
    serve_once = ex._serve_once

    def training_thread_only(st):
        if threading.current_thread() is ex._thread:
            return False
        return serve_once(st)

    waiter = ex._waiter
    ex._waiter = None   # the service thread sleeps between its (empty) looks, as it did in
    ex._serve_once = training_thread_only   # Python: its C wait would end at once, a request there
    steps = 4
    ex.start_dense(dense0)
    for step in range(1, steps + 1):
        pulled = ex.pull(ids_of(rank, step))
        grads = {n: grad_of(p.uniq, DIMS[n]) for n, p in pulled.items()}
        ex.push(pulled, grads, np.full(DENSE, rank + 1.0, np.float32))
    helped = ex.service_stats()["worker"].get("helped", 0)
    del ex._serve_once      # the service thread serves again (a peer's last pull may wait)
    ex._waiter = waiter
    ex.finish()
    if world > 1:   # (a rank whose peers' pulls all came while it was not looking may
        # have served none: its peers then served it; so count every rank's)
        helped = int(comm.allreduce(np.array([helped], np.int64), op="test:helped",
                                    mpi_op="sum")[0])
        assert helped > 0
    for n, t in tables.items():
        pushes = {}
        for r in range(world):
            for s in range(1, steps + 1):
                for k in np.unique(ids_of(r, s)[n]):
                    pushes[int(k)] = pushes.get(int(k), 0) + 1
        mine = np.array(sorted(k for k in pushes if owner_of(np.array([k]), ex.owners)[0] == rank),
                        np.int64)
        times = np.array([pushes[int(k)] for k in mine], np.float32)
        want = t.initial_values(mine) - LR * grad_of(mine, DIMS[n]) * times[:, None]
        np.testing.assert_allclose(t.find(mine), want, rtol=1e-5, atol=1e-5, err_msg=n)
    total = sum((r + 1.0) * steps for r in range(world))
    np.testing.assert_allclose(ex.dense(), dense0 - LR * total, rtol=1e-6, atol=1e-5)
    ex.close()
    for t in tables.values():
        t.close()


def test_the_service_threads_are_rung(comm, monkeypatch):
    """The service thread idles in C (kv_poll_wait), and is rung out of it: by the
    workers on its machine after each request, and by its own training thread when a
    deferred pull may now be served (its own push moved its clock). With the waiters'
    pauses and their fallback look (_IDLE) pushed to 60 s, and the training threads kept
    from serving their peers while they wait, only the doorbells get a request seen:
    an SSP(0) run (every pull waits for the previous step's pushes) still takes well
    under a second a step, and no update is lost."""
    from kvcoll.exchange import ssp

    monkeypatch.setattr(ssp, "_IDLE", 60.0)
    world, rank = comm.size, comm.rank
    tables = make_tables()
    dense0 = np.linspace(-1, 1, DENSE).astype(np.float32)
    ex = SspExchange(comm, tables, 0, dense_size=DENSE, dense_optimizer=kv.optimizers.SGD(LR))
    assert ex._waiter is not None, "the C waiter was not found for this MPI"
    assert ex._bells.own is not None
    here = [r for r, p in enumerate(comm.peers) if r != rank
            and p["boot"] == comm.peers[rank]["boot"]]
    assert ex._bells.reach == here
    ex._waiter._first = ex._waiter._most = int(60e9)
    if len(here) == world - 1:          # every peer rings: nobody needs to help
        monkeypatch.setattr(ex, "_help", lambda: None)
    t0 = time.perf_counter()
    top = drive(ex, rank, steps_of(rank), dense_init=dense0)
    took = time.perf_counter() - t0
    assert top == max(steps_of(r) for r in range(world))
    assert ex.service_stats()["service"].get("waits", 0) > 0
    assert took < 30, f"{took:.1f}s for {steps_of(rank)} steps: a ring was missed"
    total = sum((r + 1.0) * steps_of(r) for r in range(world))
    np.testing.assert_allclose(ex.dense(), dense0 - LR * total, rtol=1e-6, atol=1e-5)
    t1 = time.perf_counter()
    ex.close()
    assert time.perf_counter() - t1 < 5, "close() waited for the C waiter"
    for t in tables.values():
        t.close()


def test_without_the_c_waiter_the_service_thread_polls(comm, monkeypatch):
    """Where the MPI's probe cannot be reached from C (Comm.waiter gives None), the
    service thread polls in Python as before: no update is lost."""
    from kvcoll.comm import Comm

    monkeypatch.setattr(Comm, "waiter", lambda self, *a, **k: None)
    world, rank = comm.size, comm.rank
    tables = make_tables()
    dense0 = np.linspace(-1, 1, DENSE).astype(np.float32)
    ex = SspExchange(comm, tables, 1, dense_size=DENSE, dense_optimizer=kv.optimizers.SGD(LR))
    assert ex._waiter is None
    drive(ex, rank, steps_of(rank), dense_init=dense0)
    assert "waits" not in ex.service_stats()["service"]
    total = sum((r + 1.0) * steps_of(r) for r in range(world))
    np.testing.assert_allclose(ex.dense(), dense0 - LR * total, rtol=1e-6, atol=1e-5)
    ex.close()
    for t in tables.values():
        t.close()


@pytest.mark.parametrize("S", [0, 2])
def test_ssp_bound_is_exact(comm, S):
    world, rank = comm.size, comm.rank
    if world < 2:
        pytest.skip("needs a slow and a fast rank")
    steps, slow = 10, world - 1
    tables = make_tables()
    ex = SspExchange(comm, tables, S, dense_size=DENSE, dense_optimizer=kv.optimizers.SGD(LR))
    side = comm.dup()   # the test's own messages

    def hold(step):
        """The slow rank stays before its first push until every other rank has started
        step S + 1 (its lead over the slow rank's clock 0 is then S: the bound); those
        go no further until it pushes (the gate of step S + 2)."""
        if rank == slow and step == 1:
            for r in range(world - 1):
                side.recv(r, 81, op=f"rank {r} at step {S + 1}", timeout=60.0)
        elif rank != slow and step == S + 1:
            side.isend(np.zeros(1, np.uint8), slow, 81, op=f"at step {S + 1}").wait()

    drive(ex, rank, steps, after_pull=hold)
    assert ex.staleness_observed <= S
    leads = [tr.lead for tr in ex.trace]
    if rank != slow:
        assert max(leads) == S, leads      # the fast ranks run into the bound ...
    assert max(leads) <= S                 # ... and never past it
    # Against the truth: when rank w started step t, every rank k had finished step t-S-1
    # (recorded just before it posted that step's pushes).
    starts = comm.allgather(np.array([tr.t_start for tr in ex.trace]))
    ends = comm.allgather(np.array([tr.t_end for tr in ex.trace]))
    for w in range(world):
        for t in range(1, steps + 1):
            for k in range(world):
                finished = int((ends[k] < starts[w][t - 1]).sum())
                assert finished >= min(steps, t - S - 1), (w, t, k, finished)
    ex.close()
    side.free()
    for t in tables.values():
        t.close()


@pytest.mark.parametrize("S", [0, 2])
def test_ssp_pull_reflects_every_update_up_to_t_minus_s_minus_1(comm, S):
    """Every worker pushes gradient 1 to one shared row per step (SGD, lr 1): the row a
    worker pulls at step t has absorbed at least every worker's steps <= t - S - 1."""
    world, rank = comm.size, comm.rank
    steps = [6 + 2 * r for r in range(world)]
    t = kv.KvTable(1, name="shared", optimizer=kv.optimizers.SGD(1.0))
    ex = SspExchange(comm, {"shared": t}, S)
    seen = []
    for step in range(1, steps[rank] + 1):
        pulled = ex.pull({"shared": np.array([0], np.int64)})
        seen.append(-float(pulled["shared"].rows[0, 0]))    # pushes applied so far
        if rank == world - 1:
            time.sleep(0.02)                                 # a slower rank
        ex.push(pulled, {"shared": np.ones((1, 1), np.float32)})
    ex.finish()
    for step, applied in enumerate(seen, 1):
        due = sum(min(n, step - S - 1) for n in steps if step - S - 1 > 0)
        assert applied >= due, (step, applied, due)
    if owner_of(np.array([0]), world)[0] == rank:
        assert t.find(np.array([0]))[0, 0] == -sum(steps)   # and nothing was lost
    ex.close()
    t.close()


def test_push_per_group_equals_push_per_table_and_needs_a_pull(comm):
    """A pull's rows come as one matrix per dim (owner after owner, as in BSP); pushing
    their gradient per group updates the rows exactly as pushing it per table does.
    Row gradients with no pull before are refused, and change nothing."""
    world, rank = comm.size, comm.rank
    results = []
    for per_group in (False, True):
        tables = make_tables()
        ex = SspExchange(comm, tables, 0)
        for step in (1, 2):
            pulled = ex.pull(ids_of(rank, step))
            assert sorted(pulled.rows) == ["dim2", "dim3"]
            grads = {n: grad_of(p.uniq, DIMS[n]) for n, p in pulled.items()}
            if per_group:
                mats = {g: np.zeros_like(m) for g, m in pulled.rows.items()}
                for n, g in grads.items():
                    mats[pulled.group[n]][pulled.table_slice(n)] = g
                grads = mats
            ex.push(pulled, grads)
        ex.finish()
        results.append({n: t.find(np.arange(-10, 50)) for n, t in tables.items()})
        if per_group:
            before = {n: t.find(np.arange(-10, 50)) for n, t in tables.items()}
            with pytest.raises(kv.InvalidArgumentError, match="without this step's pull"):
                ex.push(None, {"dim3": np.ones((1, 3), np.float32)})
            for n, t in tables.items():
                assert np.array_equal(t.find(np.arange(-10, 50)), before[n])
        ex.close()
        for t in tables.values():
            t.close()
    for n in DIMS:
        assert np.array_equal(results[0][n], results[1][n]), n


def test_asp_nobody_waits_for_a_slow_rank(comm):
    world, rank = comm.size, comm.rank
    if world < 2:
        pytest.skip("needs a slow and a fast rank")
    steps, slow = 10, world - 1
    tables = make_tables()
    ex = SspExchange(comm, tables, None, dense_size=DENSE, dense_optimizer=kv.optimizers.SGD(LR))
    side = comm.dup()   # the test's own messages

    def hold(step):
        """The slow rank stays before its first push until every other rank has pulled
        its last step: were anyone to wait for it (a gate, a pull served late), that rank
        would never get there and this receive would time out."""
        if rank == slow and step == 1:
            for r in range(world - 1):
                side.recv(r, 82, op=f"rank {r} at its last step, rank {slow} held at its first",
                          timeout=60.0)
        elif rank != slow and step == steps:
            side.isend(np.zeros(1, np.uint8), slow, 82, op=f"at step {steps}").wait()

    drive(ex, rank, steps, after_pull=hold)
    if rank != slow:  # it ran all its steps ahead of the held rank's clock 0, and was served
        assert max(tr.lead for tr in ex.trace) == steps - 1, [tr.lead for tr in ex.trace]
        assert ex.staleness_observed == steps - 1
    ex.close()
    side.free()
    for t in tables.values():
        t.close()


# -- through the Keras Trainer -------------------------------------------------------------

def _trainer(mode, staleness=None, dense_opt=None):
    from tensorflow import keras

    keras.utils.set_random_seed(3)
    u = keras.Input(shape=(), dtype="int64", name="user")
    h = keras.Input(shape=(None,), dtype="int64", name="history")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    parts = [kv.Embedding("user", 4, initializer=("normal", 0, 0.1), seed=1)(u),
             kv.Embedding("item", 3, combiner="mean")(h), x]
    z = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()(parts))
    model = kv.Model({"user": u, "history": h, "x": x}, keras.layers.Dense(1)(z))
    opt = kv.DistributedOptimizer(dense_opt or keras.optimizers.Adam(0.02),
                                  sparse=kv.optimizers.Adagrad(0.2))
    return kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt,
                      step_mode=mode, staleness=staleness)


def _batch(rank, step, n=16):
    g = np.random.default_rng([9, rank, step])
    lens = g.integers(0, 4, n)
    return ({"user": g.integers(0, 40, n).astype(np.int64),
             "history": (g.integers(0, 30, lens.sum()).astype(np.int64),
                         np.concatenate([[0], np.cumsum(lens)])),
             "x": g.normal(size=(n, 3)).astype(np.float32)},
            (g.random(n) < 0.4).astype(np.float32))


@pytest.mark.parametrize("mode,staleness", [("ssp", 1), ("asp", None)])
def test_trainer_uneven_data_and_consistent_final_model(comm, mode, staleness):
    world, rank = comm.size, comm.rank
    tr = _trainer(mode, staleness)
    kv.broadcast_variables(tr.model.variables, root_rank=0)
    steps = 2 + 3 * rank                       # rank 0 runs out first
    losses = [tr.train_step(*_batch(rank, s)) for s in range(steps)]
    assert all(np.isfinite(losses))
    assert tr.finish() == 0
    assert tr.step == 2 + 3 * (world - 1) and tr.local_steps == steps
    if mode == "ssp":
        assert tr.staleness_observed <= 1 and tr.max_lead <= 1
    flat = np.concatenate([w.reshape(-1) for w in tr.model.get_weights()]).astype(np.float32)
    every = comm.allgather(flat)
    for r in range(world):
        np.testing.assert_array_equal(every[r], flat)
    # the model moved and predict (a collective after finish) sees the trained rows
    feats, _ = _batch(rank, 0)
    out = tr.predict(feats)
    assert out.shape == (16, 1) and np.isfinite(out).all()
    # a second epoch works after finish()
    tr.train_step(*_batch(rank, 100))
    tr.finish()
    tr.close()


def test_trainer_rejects_dense_optimizers_without_a_kernel(comm):
    from tensorflow import keras

    with pytest.raises(kv.InvalidArgumentError, match="RMSprop.*SGD.*Adagrad and Adam"):
        _trainer("asp", dense_opt=keras.optimizers.RMSprop(0.01))
    with pytest.raises(kv.InvalidArgumentError, match="momentum"):
        _trainer("ssp", 2, dense_opt=keras.optimizers.SGD(0.01, momentum=0.9))


def test_trainer_dense_optimizer_state_round_trips(comm):
    """The slice owners start from the Keras optimizer's state and finish() writes
    theirs back: Adam's moments and iteration count are the same on every rank and
    equal what the owners used."""
    world, rank = comm.size, comm.rank
    tr = _trainer("asp")
    kv.broadcast_variables(tr.model.variables, root_rank=0)
    for s in range(3):
        tr.train_step(*_batch(rank, s))
    tr.finish()
    opt = tr.opt
    # the optimizer counts steps (what learning-rate schedules and checkpoints read), not
    # the pushes the slice owners applied (one per rank per step)
    assert int(opt.iterations.numpy()) == 3
    m = np.concatenate([np.asarray(v).reshape(-1) for v in opt._momentums])
    assert np.abs(m).sum() > 0
    every = comm.allgather(m)
    for r in range(world):
        np.testing.assert_array_equal(every[r], m)
    # a second round continues from that state (no reset of the moments)
    tr.train_step(*_batch(rank, 7))
    tr.finish()
    assert int(opt.iterations.numpy()) == 4
    tr.close()


def _shared_dir(comm, tmp_path_factory) -> str:
    """One directory every rank sees (rank 0 makes it)."""
    path = str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None
    return comm.bcast_bytes(path.encode() if path else None).decode()


@pytest.mark.parametrize("mode,staleness", [("ssp", 1), ("asp", None)])
def test_save_past_the_staleness_restore_and_continue(comm, mode, staleness,
                                                      tmp_path_factory):
    """kv.save mid-run is a sync point (every update applied, the dense model gathered
    back), and a restored run continues from the saved step: no wait at the clock gate."""
    world, rank = comm.size, comm.rank
    d = _shared_dir(comm, tmp_path_factory)
    tr = _trainer(mode, staleness)
    for s in range(5):                                   # step 5 > staleness
        tr.train_step(*_batch(rank, s))
    info = kv.save(d, tr)
    assert info.step == tr.step == 5
    # The saved rows, read before this rank's next collective: once a peer leaves it, its
    # step 5 may push gradients into this rank's shard (SSP and ASP apply them as they come).
    rows = {n: t.export() for n, t in tr.tables.items()}
    weights = tr.model.get_weights()
    every = comm.allgather(np.concatenate([w.reshape(-1) for w in weights]))
    np.testing.assert_array_equal(every, every[:1].repeat(world, 0))  # one model everywhere
    tr.train_step(*_batch(rank, 5))                      # training goes on after a save
    tr.finish()
    tr.close()

    tr2 = _trainer(mode, staleness)
    got = kv.restore(d, tr2)
    assert got.step == tr2.step == 5
    for a, b in zip(tr2.model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    for n, t in tr2.tables.items():
        e = t.export()
        order, ref = np.argsort(e["keys"]), np.argsort(rows[n]["keys"])
        np.testing.assert_array_equal(e["values"][order], rows[n]["values"][ref])
    t0 = time.monotonic()
    for s in range(5, 9):
        assert np.isfinite(tr2.train_step(*_batch(rank, s)))
    tr2.finish()
    assert tr2.step == 9 and time.monotonic() - t0 < 30
    tr2.close()


def test_fit_in_ssp_with_a_checkpoint_callback_resumes(comm, tmp_path_factory):
    """model.fit in SSP with kv.callbacks.Checkpoint: saves at the epochs' sync points,
    and a new model resumes from them inside fit."""
    from tensorflow import keras

    world, rank = comm.size, comm.rank
    d = _shared_dir(comm, tmp_path_factory)
    tr = _trainer("ssp", 1)                               # the model is compiled
    model = tr.model
    data = [_batch(rank, s) for s in range(4 + rank)]     # uneven: rank r has 4 + r batches
    ck = kv.callbacks.Checkpoint(d, every_n_steps=3)
    model.fit(iter(data * 2), steps_per_epoch=4 + rank, epochs=2, verbose=0, callbacks=[ck])
    assert [s.step for s in ck.saves] == [4 + world - 1, 2 * (4 + world - 1)]
    tr.close()
    tr2 = _trainer("ssp", 1)
    model2 = tr2.model
    model2.compile(optimizer=tr2.opt, loss=keras.losses.BinaryCrossentropy(from_logits=True),
                   metrics=[keras.metrics.AUC(name="auc")])    # compiled again: new metrics
    ck2 = kv.callbacks.Checkpoint(d, restore=True, save_at_end=False)
    # the saved run had done its 2 epochs: a fit of 3 runs the third (epochs is the total)
    hist = model2.fit(iter(data), epochs=3, verbose=0, callbacks=[ck2])
    assert ck2.restored.step == 2 * (4 + world - 1)
    assert tr2.step == ck2.restored.step + 4 + world - 1
    assert np.isfinite(hist.history["loss"]).all() and "auc" in hist.history
    tr2.close()
