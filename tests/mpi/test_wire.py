"""fp16/bf16 rows and row gradients on the wire, at any world size (TF-free).

- BSP, exactly: every rank's rows are a one-table reference's rows rounded to the wire;
  each owner sums the rounded gradients of every rank in rank order, in float32, and
  applies them with the table's optimizer: its rows equal the reference's bit for bit,
  and stay float32 (not wire values);
- the bytes each rank sends: ids 8 bytes each, rows and gradients 2 bytes a value
  instead of 4 (bf16: exactly half of fp32's for the same batches; fp16: plus 2 bytes,
  its scale, per message), nothing for its own share;
- training through the step loop (BSP, SSP, ASP) with a numpy model: fp16 and bf16
  end within TOLERANCE of the fp32 run (loss and every row; in SSP and ASP an owner
  applies each worker's push as it arrives, in an order, and with stale reads, that the
  timing decides, so two of their fp32 runs differ too: ASYNC_TOLERANCE), and the
  tables hold float32 values;
- fp16 scales each message by a power of two (exactly as a numpy float16 reference);
- a row or a gradient beyond bf16's range (near float32's largest) refuses the step on
  every rank with the error naming the table and the key, and no table changes anywhere
  (SSP: the rank that read the row refuses its own step, at once);
- (SSP/ASP) a rank whose own step fails raises its error at once: the loop used to
  gather every rank's error text with a collective the other ranks, stepping on their
  own, never joined (it ended at the step deadline with a CommTimeoutError).
"""

import numpy as np
import pytest

from kvcoll import InvalidArgumentError, KvTable, NonFiniteError, optimizers
from kvcoll.config import StepMode
from kvcoll.exchange import OK, Agreement, BspExchange, make_exchange
from kvcoll.exchange.bsp import group_key
from kvcoll.exchange.wire import Wire
from kvcoll.routing import OwnerMap, owner_of
from kvcoll.step import Grads, Loop

DIMS = {"a": 8, "b": 3}
STEPS = 5
# How far a 16-bit run ends from the fp32 run in test_training_matches_fp32 (40 steps of
# a logistic model, rows of magnitude ~0.2): a wire's rounding step is 2^-11 (fp16) and
# 2^-8 (bf16) of a value, and training does not amplify it. Measured in BSP at 1, 2 and
# 3 ranks: rows fp16 <= 4e-5, bf16 <= 2.4e-4; losses fp16 <= 2e-6, bf16 <= 4e-5.
TOLERANCE = {"fp16": {"rows": 2e-4, "loss": 2e-5}, "bf16": {"rows": 2e-3, "loss": 4e-4}}
# SSP and ASP: the order of the pushes an owner applies (Adagrad is not linear) and the
# stale reads depend on the timing, run to run (measured: rows up to 4.3e-3 from the
# fp32 run, losses up to 1.7e-4).
ASYNC_TOLERANCE = {"rows": 2e-2, "loss": 2e-3}


def make_tables(opt="adagrad", init=1.5):
    make = {"adagrad": lambda: optimizers.Adagrad(0.2), "sgd": lambda: optimizers.SGD(0.5)}
    return {n: KvTable(d, name=n, seed=7, initializer=("uniform", -init, init),
                       optimizer=make[opt]()) for n, d in DIMS.items()}


def batch_of(rank, step):
    rng = np.random.default_rng([3, rank, step])
    return {"a": rng.integers(0, 80, 60).astype(np.int64),
            "b": rng.integers(-20, 20, 25).astype(np.int64)}


def grad_of(rank, uniq, dim):
    """A fixed gradient per (rank, id), with values across fp16's precision."""
    base = (np.asarray(uniq, np.float64)[:, None] * 0.0137 + rank * 0.11
            + np.arange(dim)[None] * 0.031)
    return (np.sin(base) * 0.3).astype(np.float32)


def rounded(x, wire):
    out = np.ascontiguousarray(x, np.float32).copy()
    wire.round(out)
    return out


def f16_exponent(values) -> int:
    """fp16's scale of a segment (csrc/kv_wire.h): m * 2^k lies in [2^14, 2^15) for its
    largest finite magnitude m, i.e. k = 14 - floor(log2 m), within [-126, 126]."""
    v = np.abs(np.asarray(values, np.float32))
    m = v[np.isfinite(v)].max(initial=0)
    return 0 if m == 0 else int(np.clip(14 - np.floor(np.log2(m)), -126, 126))


def by_owner(values: dict, keys: dict, wire, world: int) -> dict:
    """values[table] (rows of keys[table]) as they read after crossing the wire in one
    segment per owner (every table's rows of one owner together), by numpy's float16
    (round to nearest even) for fp16, the C rounding for bf16 (which has no scale)."""
    out = {n: np.array(v, np.float32, copy=True) for n, v in values.items()}
    if wire.name == "bf16":
        for v in out.values():
            wire.round(v)
        return out
    owner = {n: owner_of(keys[n], OwnerMap.even(world)) for n in values}
    for o in range(world):
        k = f16_exponent(np.concatenate([values[n][owner[n] == o].ravel() for n in values]))
        for n, v in values.items():
            sel = owner[n] == o
            scaled = (v[sel] * np.float32(2.0 ** k)).astype(np.float16).astype(np.float32)
            out[n][sel] = scaled * np.float32(2.0 ** -k)
    return out


def export_sorted(t):
    """A table's rows by key: what a refused step must leave as it was (a lookup stamps
    its step on the rows it read, as it does in any step)."""
    e = t.export()
    order = np.argsort(e["keys"])
    return {k: e[k][order] for k in ("keys", "values", "slots", "counts")}


@pytest.mark.parametrize("wire_dtype", ["fp16", "bf16"])
def test_bsp_rows_and_sums_at_the_wire_width(comm, wire_dtype):
    world, me = comm.size, comm.rank
    wire = Wire(wire_dtype)
    dist, ref = make_tables(), make_tables()
    owners = OwnerMap.even(world)
    ex = BspExchange(comm, dist, wire_dtype=wire_dtype)
    for step in range(1, STEPS + 1):
        pull = ex.pull(batch_of(me, step))
        uniq = {n: p.uniq for n, p in pull.items()}
        want = by_owner({n: ref[n].find_or_create(u, step=step) for n, u in uniq.items()},
                        uniq, wire, world)   # the reference's rows, as they cross the wire
        for n, p in pull.items():
            np.testing.assert_array_equal(p.rows, want[n], err_msg=n)
        ex.push(pull, {n: grad_of(me, p.uniq, DIMS[n]) for n, p in pull.items()}).commit()
        sums = {n: {} for n in DIMS}   # each id's rounded gradients, in rank order, float32
        for r in range(world):
            u = {n: np.unique(batch_of(r, step)[n]) for n in DIMS}
            sent = by_owner({n: grad_of(r, u[n], DIMS[n]) for n in DIMS}, u, wire, world)
            for n in DIMS:
                for k, g in zip(u[n], sent[n]):
                    sums[n][int(k)] = g if int(k) not in sums[n] else sums[n][int(k)] + g
        for n in DIMS:
            keys = np.array(sorted(sums[n]), np.int64)
            ref[n].find_or_create(keys, step=step)
            ref[n].apply_gradients(keys, np.stack([sums[n][int(k)] for k in keys]), step=step)
    for n, t in dist.items():
        got = export_sorted(t)
        assert (owner_of(got["keys"], owners) == me).all()
        want = ref[n].find(got["keys"])
        np.testing.assert_array_equal(got["values"], want, err_msg=n)
        assert got["values"].dtype == np.float32
        if got["values"].size:   # float32 values, most of them no wire value
            assert (rounded(got["values"], wire) != got["values"]).mean() > 0.5
    for t in [*dist.values(), *ref.values()]:
        t.close()


def test_bytes_on_the_wire_are_halved(comm):
    world, me = comm.size, comm.rank
    owners = OwnerMap.even(world)
    sent = {}
    for wire_dtype in ("fp32", "fp16", "bf16"):
        tabs = make_tables("sgd")
        ex = BspExchange(comm, tabs, wire_dtype=wire_dtype)
        for step in range(1, STEPS + 1):
            pull = ex.pull(batch_of(me, step))
            ex.push(pull, {n: grad_of(me, p.uniq, DIMS[n]) for n, p in pull.items()}).commit()
        sent[wire_dtype] = dict(ex.wire_bytes)
        for t in tabs.values():
            t.close()
    # what the batches say: ids and gradients to the other owners, rows to the others;
    # fp16 adds its 2-byte exponent to every message that is not empty
    ids = rows = grads = messages_rows = messages_grads = 0
    for step in range(1, STEPS + 1):
        to = np.zeros(world, np.int64)          # values this rank sends each owner
        back = np.zeros(world, np.int64)        # rows this rank sends each requester
        for n, d in DIMS.items():
            mine = np.unique(batch_of(me, step)[n])
            to += d * np.bincount(owner_of(mine, owners), minlength=world)
            ids += 8 * int((owner_of(mine, owners) != me).sum())
            for r in range(world):
                theirs = np.unique(batch_of(r, step)[n])
                back[r] += d * int((owner_of(theirs, owners) == me).sum())
        to[me] = back[me] = 0
        grads += 4 * int(to.sum())
        rows += 4 * int(back.sum())
        messages_grads += int((to > 0).sum())
        messages_rows += int((back > 0).sum())
    assert sent["fp32"] == {"ids": ids, "rows": rows, "grads": grads}
    assert sent["bf16"] == {"ids": ids, "rows": rows // 2, "grads": grads // 2}
    assert sent["fp16"] == {"ids": ids, "rows": rows // 2 + 2 * messages_rows,
                            "grads": grads // 2 + 2 * messages_grads}
    if world > 1:
        assert ids > 0 and rows > 0 and grads > 0


class Logistic:
    """p = sigmoid(sum over tables of the id's row . w_t) with fixed w_t: row gradients
    only (no dense part), written out in numpy."""

    n_dense, dense_slots = 0, 0

    def __init__(self):
        self.w = {n: np.linspace(-1, 1, d).astype(np.float32) for n, d in DIMS.items()}
        self._state = np.zeros(2, np.float32)

    def prepare(self, element, x_only=False):
        ids, y = element
        if y is None:
            raise InvalidArgumentError("this batch has no labels")

        class B:
            pass
        b = B()
        b.ids, b.y, b.n = ids, y, len(y)
        return b

    def ids(self, batch):
        return dict(batch.ids) if batch is not None else \
            {n: np.zeros(0, np.int64) for n in DIMS}

    def _logit(self, batch, pull):
        z = np.zeros(batch.n, np.float32)
        for n in DIMS:
            z += pull.rows[group_key(DIMS[n])][pull.pos[n]] @ self.w[n]
        return 1 / (1 + np.exp(-z))

    def train(self, batch, pull, weight):
        p = self._logit(batch, pull)
        loss = float(-np.mean(batch.y * np.log(p) + (1 - batch.y) * np.log(1 - p)))
        d = ((p - batch.y) / batch.n * weight).astype(np.float32)
        rows = {g: np.zeros_like(m) for g, m in pull.rows.items()}
        for n in DIMS:
            np.add.at(rows[group_key(DIMS[n])], pull.pos[n], d[:, None] * self.w[n][None])
        state = self._state + np.array([loss * batch.n, batch.n], np.float32)
        return Grads(loss * weight, None, rows, state, bool(np.isfinite(loss)))

    def zero_grads(self, pull):
        return Grads(0.0, None, {g: np.zeros_like(m) for g, m in pull.rows.items()},
                     self._state)

    def evaluate(self, batch, pull):
        p = self._logit(batch, pull)
        loss = float(-np.mean(batch.y * np.log(p) + (1 - batch.y) * np.log(1 - p)))
        return self._state + np.array([loss * batch.n, batch.n], np.float32)

    def predict(self, batch, pull):
        return self._logit(batch, pull)

    def state(self):
        return self._state

    def set_state(self, state):
        self._state = np.asarray(state, np.float32)

    def apply(self, dense_sum, state, step):
        return self.logs(state)

    def logs(self, state):
        return {"loss": float(state[0] / max(state[1], 1))}

    def rates(self, step):
        return None, None

    def dense_values(self):
        return np.zeros(0, np.float32), None, 0

    def set_dense_values(self, flat, state=None, updates=None):
        pass

    def explain(self, batch):
        return None


def element(rank, step):
    ids = batch_of(rank, step)
    ids = {"a": ids["a"][:24], "b": ids["b"][:24]}
    y = ((ids["a"] % 3 == 0) ^ (ids["b"] > 5)).astype(np.float32)
    return ids, y


MODES = {"bsp": StepMode("bsp"), "ssp": StepMode("ssp", 1), "asp": StepMode("asp"),
         "ssp0": StepMode("ssp", 0), "ssp2": StepMode("ssp", 2)}


def train(comm, mode, wire_dtype, steps=40):
    """The loss over every rank's held-out batches after `steps` steps, and every
    table's (keys, values) on this rank."""
    tabs = make_tables(init=0.2)
    loop = Loop(make_exchange(comm, tabs, MODES[mode], wire_dtype=wire_dtype), Logistic())
    for step in range(1, steps + 1):
        loop.train(element(comm.rank, step))
    loop.finish()
    loop.compute.set_state(np.zeros(2, np.float32))
    for step in range(1000, 1004):     # evaluation reads rows at the wire's width too
        logs = loop.evaluate(element(comm.rank, step))
    out = {n: export_sorted(t) for n, t in tabs.items()}
    loop.close()
    for t in tabs.values():
        t.close()
    return logs["loss"], out


@pytest.mark.parametrize("mode", ["bsp", "ssp0", "ssp2", "asp"])
def test_training_matches_fp32(comm, mode):
    loss32, rows32 = train(comm, mode, "fp32")
    for wire_dtype, tol in TOLERANCE.items():
        if mode != "bsp":
            tol = ASYNC_TOLERANCE
        loss, rows = train(comm, mode, wire_dtype)
        assert abs(loss - loss32) <= tol["loss"], (wire_dtype, loss, loss32)
        for n in DIMS:
            np.testing.assert_array_equal(rows[n]["keys"], rows32[n]["keys"])
            diff = np.abs(rows[n]["values"] - rows32[n]["values"]).max(initial=0)
            assert diff <= tol["rows"], (wire_dtype, n, diff)
            assert rows[n]["values"].dtype == np.float32
            if rows[n]["values"].size:
                wire = Wire(wire_dtype)
                assert (rounded(rows[n]["values"], wire) != rows[n]["values"]).mean() > 0.5
        if comm.rank == 0:
            diffs = {n: np.abs(rows[n]["values"] - rows32[n]["values"]).max(initial=0)
                     for n in DIMS}
            print(f"{mode} {wire_dtype}: loss {loss:.6f} vs fp32 {loss32:.6f}; rows max diff "
                  + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))


def test_a_gradient_beyond_bf16_is_refused_on_every_rank(comm):
    world, me = comm.size, comm.rank
    tabs = make_tables()
    ex = BspExchange(comm, tabs, wire_dtype="bf16")
    before = {n: export_sorted(t) for n, t in tabs.items()}
    agreement = Agreement(5)
    pull = ex.pull({"a": np.array([5, 6, 7]), "b": np.array([1])}, agreement)
    grads = {n: grad_of(me, p.uniq, DIMS[n]) for n, p in pull.items()}
    last = world - 1
    if me == last:
        grads["a"][list(pull["a"].uniq).index(6), 2] = 3.4e38
    agreement.report(OK)
    pushed = ex.push(pull, grads, None, np.zeros(1, np.float32), agreement)
    pushed.reduced()
    assert agreement.outcome_failed == [last]
    if me == last:
        assert "table 'a', key 6: a value of its row gradient is 3.4e+38, beyond bf16" in \
            str(agreement.outcome_error)
    ex.abandon(pushed)
    for n, t in tabs.items():
        after = export_sorted(t)
        for k in before[n]:
            np.testing.assert_array_equal(before[n][k], after[k], err_msg=f"{n} {k}")
    for t in tabs.values():
        t.close()


@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_a_row_beyond_bf16_fails_the_step_on_every_rank(comm, mode):
    world, me = comm.size, comm.rank
    tabs = make_tables()
    key = 33                           # owned by some rank, read by the last one only
    owner = int(owner_of(np.array([key]), OwnerMap.even(world))[0])
    if me == owner:
        tabs["a"].apply_gradients(np.array([key]), np.zeros((1, DIMS["a"]), np.float32),
                                  step=1, create_missing=True)   # a trained row
        tabs["a"].update(np.array([key]), np.full((1, DIMS["a"]), -3.4e38, np.float32))
    before = {n: export_sorted(t) for n, t in tabs.items()}
    mode = MODES[mode] if mode == "bsp" else StepMode("ssp", 0)
    loop = Loop(make_exchange(comm, tabs, mode, wire_dtype="bf16"), Logistic())
    ids, y = element(me, 1)
    ids["a"] = ids["a"] % 30                   # keys below 30: all fit
    if me == world - 1:
        ids["a"][3] = key
    if mode.name == "bsp":                     # every rank raises (the agreed error)
        with pytest.raises(NonFiniteError, match=f"table 'a', key {key}: a value of its row"):
            loop.train((ids, y))
        for n, t in tabs.items():
            after = export_sorted(t)
            for k in before[n]:
                np.testing.assert_array_equal(before[n][k], after[k], err_msg=f"{n} {k}")
    elif me == world - 1:                      # SSP: the rank that read it
        with pytest.raises(NonFiniteError, match=f"table 'a', key {key}: a value of its row"):
            loop.train((ids, y))
        assert loop.step == 0
    else:
        loop.train((ids, y))
    if mode.name != "bsp":
        loop.finish()
    loop.close()
    for t in tabs.values():
        t.close()


@pytest.mark.parametrize("mode", ["ssp", "asp"])
def test_ssp_a_bad_batch_on_one_rank_is_its_own_error_at_once(comm, mode):
    world, me = comm.size, comm.rank
    tabs = make_tables()
    loop = Loop(make_exchange(comm, tabs, MODES[mode]), Logistic())
    ids, y = element(me, 1)
    if me == world - 1:
        with pytest.raises(InvalidArgumentError, match="this batch has no labels"):
            loop.train((ids, None))
        assert loop.step == 0
    else:
        loop.train((ids, y))
    loop.finish()
    loop.close()
    for t in tabs.values():
        t.close()
