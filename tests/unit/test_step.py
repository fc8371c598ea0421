"""kvcoll.step's loop with a fake exchange and a numpy compute: no MPI, no TensorFlow.

The fake exchange (one rank) keeps its tables as dicts and applies SGD; the compute is a
logistic model over one table's rows and a dense weight vector, with gradients written
out. They check what the loop promises whatever the exchange and the model: a step is
pull -> compute -> push -> commit; a bad batch or a NaN leaves every table, slot, metric
and counter as before the step; abandon and replan; prefetch changes nothing of the
results and counts as consumed only committed elements.
"""

import subprocess
import sys

import numpy as np
import pytest

from kvcoll import errors
from kvcoll.step import END, IDLE, DataFailure, Grads, Loop, StepResult

DIM, LR = 3, 0.1


class FakeComm:
    def __init__(self, name="one"):
        self.size, self.rank, self.name, self.step = 1, 0, name, 0

    def allreduce(self, arr, op="allreduce", mpi_op=None):
        return np.array(arr, copy=True)

    def allgather_json(self, obj, op=""):
        return [obj]


class FakePull:
    def __init__(self, step, keys, rows, created):
        self.step, self.keys, self.created = step, keys, created
        self.rows = {"g": rows}
        self.pos = None
        self.dense = None


class FakePushed:
    def __init__(self, ex, pull, grads, dense, extra, agreement):
        self.ex, self.pull, self.grads, self.agreement = ex, pull, grads, agreement
        self.total = (dense, extra)

    def reduced(self):
        self.agreement.settle_outcome(np.array([self.agreement.outcome], np.float32))
        return self.total

    def commit(self):
        for k, g in zip(self.pull.keys, self.grads["g"]):
            self.ex.table[int(k)] = self.ex.table[int(k)] - LR * g
        self.ex.pull_inflight = None


class FakeExchange:
    """One rank's exchange of one table "t" (dict key -> row), SGD on commit."""

    synchronous = True

    def __init__(self, comm):
        self.comm, self.step, self.table = comm, 0, {}
        self.log = []

    def send_ids(self, ids, agreement, create=True):
        return (ids, agreement, create)

    def fetch(self, pending, ahead=False, comm=None):
        ids, agreement, create = pending
        if not agreement.settle(agreement.header()[None]).proceeds:
            return None
        keys, inv = np.unique(ids["t"], return_inverse=True)
        created = [int(k) for k in keys if int(k) not in self.table]
        for k in created:
            self.table[k] = np.full(DIM, 0.01 * k, np.float32)
        rows = np.stack([self.table[int(k)] for k in keys]) if keys.size \
            else np.zeros((0, DIM), np.float32)
        pull = FakePull(self.step + 1, keys, rows, created)
        pull.pos = {"t": inv}
        self.log.append(("fetch ahead" if ahead else "pull", pull.step))
        if not ahead:
            self.begin(pull)
        return pull

    def begin(self, pull):
        self.step = pull.step

    def pull(self, ids, agreement, dense=False):
        return self.fetch(self.send_ids(ids, agreement))

    def lookup(self, ids, agreement):
        if not agreement.settle(agreement.header()[None]).proceeds:
            return None
        keys, inv = np.unique(ids["t"], return_inverse=True)
        rows = np.stack([self.table.get(int(k), np.zeros(DIM, np.float32)) for k in keys]) \
            if keys.size else np.zeros((0, DIM), np.float32)
        pull = FakePull(self.step, keys, rows, [])
        pull.pos = {"t": inv}
        return pull

    def push(self, pull, grads, dense_grad=None, extra=None, agreement=None, lr=None,
             dense_lr=None):
        self.log.append(("push", pull.step))
        return FakePushed(self, pull, grads, dense_grad, extra, agreement)

    def abandon(self, step):
        pull = step.pull if isinstance(step, FakePushed) else step
        for k in pull.created:
            del self.table[k]
        if self.step == pull.step:
            self.step -= 1
        self.log.append(("abandon", pull.step))

    def finish(self):
        return self.step

    def set_step(self, step):
        self.step = step

    def set_dense(self, *a, **k):
        pass

    def dense(self):
        return None

    def replan(self, comm, owners=None):
        self.comm, self.owners = comm, owners

    def close(self):
        pass


class Batch:
    def __init__(self, ids, y, x=None):
        self.ids, self.y, self.n = ids, y, len(ids)
        self.x = x


class LogisticCompute:
    """p = sigmoid(row(id) . w); metric state: [sum of loss, count]."""

    n_dense, dense_slots = DIM, 0

    def __init__(self):
        self.w = np.ones(DIM, np.float32) * 0.5
        self._state = np.zeros(2, np.float32)

    def prepare(self, element, x_only=False):
        ids, y = element
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(f"ids must be integers, got {ids.dtype}")
        return Batch(ids.astype(np.int64), np.asarray(y, np.float32))

    def ids(self, batch):
        return {"t": batch.ids if batch is not None else np.zeros(0, np.int64)}

    def _forward(self, batch, pull):
        rows = pull.rows["g"][pull.pos["t"]]
        p = 1 / (1 + np.exp(-(rows @ self.w)))
        return rows, p

    def train(self, batch, pull, weight):
        rows, p = self._forward(batch, pull)
        y = batch.y
        loss = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
        d = (p - y) / batch.n * weight
        dense = (rows * d[:, None]).sum(0).astype(np.float32)
        grow = np.zeros_like(pull.rows["g"])
        np.add.at(grow, pull.pos["t"], d[:, None] * self.w[None])
        state = self._state + np.array([loss * batch.n, batch.n], np.float32)
        finite = bool(np.isfinite(loss) and np.isfinite(dense).all() and np.isfinite(grow).all())
        return Grads(loss * weight, dense, {"g": grow}, state, finite)

    def zero_grads(self, pull):
        return Grads(0.0, np.zeros(DIM, np.float32), {"g": np.zeros_like(pull.rows["g"])},
                     self._state)

    def evaluate(self, batch, pull):
        _, p = self._forward(batch, pull)
        loss = -np.mean(batch.y * np.log(p) + (1 - batch.y) * np.log(1 - p))
        return self._state + np.array([loss * batch.n, batch.n], np.float32)

    def predict(self, batch, pull):
        return self._forward(batch, pull)[1]

    def state(self):
        return self._state

    def set_state(self, state):
        self._state = np.asarray(state, np.float32)

    def apply(self, dense_sum, state, step):
        if dense_sum is not None:
            self.w = self.w - LR * dense_sum
        return self.logs(state)

    def logs(self, state):
        return {"loss": float(state[0] / max(state[1], 1))}

    def rates(self, step):
        return None, None

    def dense_values(self):
        return self.w.copy(), None, 0

    def set_dense_values(self, flat, state=None, updates=None):
        self.w = np.asarray(flat, np.float32).copy()

    def explain(self, batch):
        bad = np.flatnonzero(~np.isfinite(batch.y))
        return f"label is not finite in row {int(bad[0])}" if bad.size else None


def data(n_batches=6, n=16, seed=0):
    g = np.random.default_rng(seed)
    return [(g.integers(0, 12, n), (g.random(n) < 0.5).astype(np.float32))
            for _ in range(n_batches)]


def make(prefetch=False, stale_rows=False):
    ex = FakeExchange(FakeComm())
    return Loop(ex, LogisticCompute(), prefetch=prefetch, stale_rows=stale_rows), ex


def snapshot(loop, ex):
    return ({k: v.copy() for k, v in ex.table.items()}, loop.compute.w.copy(),
            loop.compute.state().copy(), ex.step, loop.consumed, loop.local_steps)


def same(a, b):
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        np.testing.assert_array_equal(a[0][k], b[0][k])
    for x, y in zip(a[1:], b[1:]):
        np.testing.assert_array_equal(x, y)


def test_the_loop_imports_no_tensorflow():
    code = ("import sys, kvcoll.step, kvcoll.exchange; "
            "sys.exit(1 if 'tensorflow' in sys.modules or 'keras' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_step_is_pull_compute_push_commit():
    loop, ex = make()
    out = loop.train(data()[0])
    assert isinstance(out, StepResult) and out.logs["loss"] > 0
    assert ex.log == [("pull", 1), ("push", 1)] and loop.step == 1
    assert loop.consumed == 1 and loop.local_steps == 1
    losses = [loop.train(b).loss for b in data(40)[1:]]
    assert losses[-1] < losses[0]                  # it learns


def test_end_of_data_idle_and_stop():
    loop, ex = make()
    assert loop.train(END) is None and ex.step == 0          # all done: no step
    assert loop.train((np.zeros(0, np.int64), np.zeros(0))) is IDLE
    loop.stop_asked = True
    assert loop.train(data()[0]) is None and ex.step == 0    # a stop: no step


def test_a_bad_batch_changes_nothing_and_raises_the_agreed_error():
    loop, ex = make()
    loop.train(data()[0])
    before = snapshot(loop, ex)
    with pytest.raises(errors.InvalidArgumentError, match=r"at step 2: rank 0: .*integers"):
        loop.train((np.array([0.5, 1.5]), np.ones(2)))
    same(before, snapshot(loop, ex))
    with pytest.raises(errors.InvalidArgumentError, match="could not use their batch") as e:
        loop.train(DataFailure(errors.InvalidArgumentError("file f, row 3: null label")))
    assert "file f, row 3" in str(e.value)
    same(before, snapshot(loop, ex))


def test_a_nan_step_is_abandoned_and_says_which_input():
    loop, ex = make()
    loop.train(data()[0])
    before = snapshot(loop, ex)
    ids, y = data(seed=3)[0]
    y = y.copy()
    y[5] = np.nan
    with pytest.raises(errors.NonFiniteError, match="label is not finite in row 5"):
        loop.train((ids + 100, y))                  # new ids: rows created, then removed
    same(before, snapshot(loop, ex))
    assert ex.log[-1] == ("abandon", 2)


def lost(*a, **k):
    """An exchange's push when a peer is lost."""
    raise errors.CommError("rank 1 lost")


def test_abandon_gives_up_the_step_in_flight():
    """A peer lost in the middle of a step (here: the push raises): abandon() leaves the
    tables, the model, the metrics and the counters as before the step."""
    loop, ex = make()
    loop.train(data()[0])
    before = snapshot(loop, ex)
    ids, y = data(seed=4)[0]
    real = ex.push
    ex.push = lost
    with pytest.raises(errors.CommError):
        loop.train((ids + 50, y))                           # new rows were created
    loop.abandon()
    same(before, snapshot(loop, ex))
    ex.push = real
    out = loop.train(data(seed=5)[0])                       # and the loop goes on
    assert out is not None and loop.step == 2


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("between", [False, True], ids=["in-a-step", "between-steps"])
def test_an_abandoned_step_tried_again_skips_no_data(prefetch, between):
    """What an elastic retry does (kvcoll.elastic): the element the abandoned step read,
    and the one prefetched after it, are the next ones trained on, so the run equals one
    without the loss. between: the loss came after step 3 (a save), with step 4's element
    prefetched."""
    runs = []
    for lose in (False, True):
        loop, ex = make(prefetch)
        it = iter(data(8))
        losses, real = [], ex.push
        while len(losses) < 7:
            if lose and len(losses) == 3:
                lose = False
                if not between:
                    ex.push = lost
                    with pytest.raises(errors.CommError):
                        loop.train_next(it)
                    ex.push = real
                loop.abandon()
                continue
            losses.append(loop.train_next(it).loss)
        runs.append((losses, snapshot(loop, ex)))
    assert runs[0][0] == runs[1][0]
    same(runs[0][1], runs[1][1])


def test_replan_continues_on_another_communicator():
    loop, ex = make()
    loop.train(data()[0])
    other = FakeComm("smaller")
    loop.replan(other, owners="a map")
    assert loop.comm is other and ex.comm is other and ex.owners == "a map"
    assert loop.train(data()[1]) is not None and loop.step == 2


def test_replan_to_another_size_drops_what_an_abandoned_step_read():
    """(read for the old world: a source of global batches splits them anew)"""
    loop, ex = make()
    batches = data(4)
    it = iter(batches)
    loop.train_next(it)
    real = ex.push
    ex.push = lost
    with pytest.raises(errors.CommError):
        loop.train_next(it)                               # reads batch 1
    ex.push = real
    two = FakeComm("two")
    two.size = 2
    loop.replan(two)
    seen, prepare = [], loop.compute.prepare

    def seeing(element, **kw):
        seen.append(element)
        return prepare(element, **kw)

    loop.compute.prepare = seeing
    loop.train_next(it)
    assert seen[0] is batches[2]


def test_prefetch_gives_the_same_results_and_counts_only_committed_elements():
    results = []
    for prefetch in (False, True):
        loop, ex = make(prefetch)
        it = iter(data(8))
        losses = []
        for _ in range(5):
            losses.append(loop.train_next(it).loss)
        if prefetch:
            assert loop._staged is not None and loop.consumed == 5   # the 6th is staged
        results.append((losses, snapshot(loop, ex)))
    assert results[0][0] == results[1][0]
    same(results[0][1], results[1][1])


def test_evaluate_and_predict_change_no_table():
    loop, ex = make()
    for b in data(3):
        loop.train(b)
    before = snapshot(loop, ex)
    logs = loop.evaluate((np.array([0, 1, 99]), np.array([1.0, 0.0, 1.0])))
    assert logs["loss"] > 0 and 99 not in ex.table
    more, out = loop.predict((np.array([0, 99]), None))
    assert more and out.shape == (2,)
    assert loop.predict(END) == (False, None)
    same(before[:2], snapshot(loop, ex)[:2])     # the metric state is the evaluation's


def test_pipeline_reads_in_a_helper_thread_and_stages_only_when_asked(monkeypatch):
    """... and the helper's C kernels run on the pool of the cores TensorFlow leaves
    free (they run beside the dense compute), the step's own on the rank's cores."""
    import threading

    from kvcoll.exchange import kernels

    loop, ex = make(prefetch=True)
    names, pools = [], []

    def batches():
        for b in data(6):
            names.append(threading.current_thread().name)
            pools.append(kernels.threads())
            yield b

    with monkeypatch.context() as m:
        m.setattr(kernels, "core_share", lambda: 3)
        m.setattr(kernels, "default_threads", lambda: 1)
        m.setattr(kernels, "_setting", lambda: 0)
        kernels.set_threads(None)
        try:
            it = batches()
            loop.train_next(it)                       # read here, the next one staged
            assert loop._staged is not None and loop._staged.done is None   # joined
            loop.train_next(it, stage=False)          # the pass's last step: nothing staged
        finally:
            m.undo()
            kernels.set_threads(None)
    assert loop._staged is None
    assert names == [threading.current_thread().name, "kvcoll-prefetch"]
    assert pools == [3, 1]


def test_one_helper_thread_stages_every_step_and_ends_when_idle_or_closed(monkeypatch):
    import threading
    import time

    from kvcoll import step as step_module

    loop, ex = make(prefetch=True)
    readers = []

    def batches():
        for b in data(8):
            readers.append(threading.get_ident())
            yield b

    it = batches()
    for _ in range(4):
        loop.train_next(it)
    helper = loop._helper._thread
    assert helper is not None and helper.is_alive()
    assert len(set(readers[1:])) == 1 and readers[0] == threading.get_ident()
    loop.drop_staged()
    loop.close()
    helper.join(10)
    assert not helper.is_alive() and loop._helper._thread is None

    monkeypatch.setattr(step_module._Helper, "IDLE", 0.05)   # idle: it ends, and comes back
    loop, ex = make(prefetch=True)
    it = iter(data(8))
    loop.train_next(it)
    first = loop._helper._thread
    loop.train_next(it)   # its staging done, the helper has nothing to do: it ends
    first.join(10)
    assert not first.is_alive()
    time.sleep(0.01)
    assert loop.train_next(it) is not None   # staged on a new helper thread
    assert loop._helper._thread is not None and loop._helper._thread is not first
    loop.close()


def test_a_stop_asked_after_the_next_vote_went_out_gives_up_that_step():
    """With prefetch the next step's vote is sent during this step; a stop asked after
    it (a callback) rides the next step's allreduce: that step is abandoned (its new
    rows removed, nothing applied) and the loop stops, as the vote would have."""
    ref, ref_ex = make()
    loop, ex = make(prefetch=True)
    batches = data(6)
    for b in batches[:3]:
        ref.train(b)
    it = iter([(ids + 40 * k, y) for k, (ids, y) in enumerate(batches)])  # new rows
    for _ in range(3):
        loop.train_next(it)
    loop.stop_asked = True
    assert loop.train_next(it) is None and loop.stop_asked
    assert loop._staged is None and ex.log[-1] == ("abandon", 4)
    assert ex.step == 3 and loop.consumed == 3 and loop.local_steps == 3
    shifted = {k: v for k, v in ex.table.items()}
    assert len(shifted) == len({int(i) + 40 * k for k, (ids, _) in enumerate(batches[:3])
                                for i in ids})


def test_a_helper_failure_other_than_data_is_raised_on_the_main_thread():
    loop, ex = make(prefetch=True)
    it = iter(data(4))
    real = ex.send_ids
    loop.train_next(it)                           # staged with the real send_ids
    ex.send_ids = lambda *a, **k: (_ for _ in ()).throw(errors.CommError("lost rank 1"))
    with pytest.raises(errors.CommError, match="lost rank 1"):
        loop.train_next(it)                       # step 2 ran; its staging failed
    assert ex.step == 2
    ex.send_ids = real
    loop.abandon()
    assert loop.train_next(it) is not None and ex.step == 3


def test_an_outcome_sum_that_is_not_a_number_counts_as_failed():
    """An elastic recovery can leave a step's reduced outcome codes undefined: the ranks
    whose code is not finite failed, without numpy's cast warning."""
    import warnings

    from kvcoll.exchange.agreement import Agreement
    a = Agreement(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a.settle_outcome(np.array([0.0, np.nan, 0.0, np.inf], np.float32))
    assert a.outcome_failed == [1, 3]


@pytest.mark.parametrize("threaded", [True, False])
def test_stale_rows_fetch_the_next_rows_before_this_steps_update(threaded):
    """TorchRec's semi-synchronous pipeline: step k + 1's rows are fetched while step k
    computes, before its update: they are the table as step k - 1 left it (rows step k
    changed read one step stale), and new rows are created then. Deterministic: the
    same with the fetch in the helper thread or inline."""
    loop, ex = make(prefetch=True, stale_rows=True)
    loop.threaded = threaded
    fetched = {}
    real = ex.fetch

    def recording(pending, ahead=False, comm=None):
        pull = real(pending, ahead=ahead, comm=comm)
        fetched[pull.step] = (ahead, dict(zip(map(int, pull.keys), pull.rows["g"])))
        return pull

    ex.fetch = recording
    after = {0: {}}                 # the table after each committed step
    it = iter(data(8, seed=3))
    for k in range(1, 7):
        loop.train_next(it)
        after[k] = {key: v.copy() for key, v in ex.table.items()}
        assert ex.step == k and loop.consumed == k
    stale = 0
    for k in range(2, 7):
        ahead, rows = fetched[k]
        assert ahead
        for key, row in rows.items():
            if key in after[k - 2]:
                np.testing.assert_array_equal(row, after[k - 2][key])
                stale += not np.array_equal(row, after[k - 1][key])
            else:
                assert key not in after[k - 2]       # created by the fetch ahead
    assert stale > 0                                 # some rows missed step k - 1's update
    assert ("fetch ahead", 7) in ex.log and 7 in fetched   # step 7 is staged, not begun
    assert ex.step == 6 and loop._staged is not None


def test_stale_rows_a_dropped_step_removes_the_rows_its_fetch_created():
    """A stop asked after step 3 gives step 4 up (fetched ahead while step 3 ran): its
    new rows go, and every counter is as after step 3."""
    loop, ex = make(prefetch=True, stale_rows=True)
    batches = data(6)
    it = iter([(ids + 40 * k, y) for k, (ids, y) in enumerate(batches)])  # new rows
    for _ in range(3):
        loop.train_next(it)
    loop.stop_asked = True
    assert loop.train_next(it) is None and loop.stop_asked
    assert loop._staged is None and ex.step == 3 and loop.consumed == 3
    assert len(ex.table) == len({int(i) + 40 * k for k, (ids, _) in enumerate(batches[:3])
                                 for i in ids})
    # step 5, staged while step 4 ran, carried the stop in its vote: nothing fetched
    assert ex.log[-1] == ("abandon", 4) and ("fetch ahead", 5) not in ex.log


def test_stale_rows_a_failed_step_removes_its_rows_and_those_fetched_ahead():
    """Step 4's loss is NaN: it is given up with step 5, whose rows were fetched (and
    created) while step 4 computed; the rows step 4's fetch created (while step 3
    computed) go too: the table is as step 3 left it."""
    loop, ex = make(prefetch=True, stale_rows=True)
    batches = [(ids + 40 * k, y) for k, (ids, y) in enumerate(data(6))]   # new rows
    batches[3] = (batches[3][0], np.full(len(batches[3][1]), np.nan, np.float32))
    it = iter(batches)
    for _ in range(3):
        loop.train_next(it)
    before = snapshot(loop, ex)
    with pytest.raises(errors.NonFiniteError, match="step 4"):
        loop.train_next(it)
    assert ex.log[-2:] == [("abandon", 5), ("abandon", 4)]
    assert loop._staged is None and ex.step == 3 and loop.consumed == 3
    first3 = {int(i) for ids, _ in batches[:3] for i in ids}
    assert set(ex.table) == first3          # step 4's rows (created ahead) went
    for key in first3:
        np.testing.assert_array_equal(ex.table[key], before[0][key])
