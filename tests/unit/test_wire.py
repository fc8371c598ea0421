"""Rows and row gradients on the wire as fp16/bf16 (kvcoll.exchange.wire), in one process.

- the setting: kv.init(wire_dtype=...), --wire-dtype, KVCOLL_WIRE_DTYPE; fp32 by default;
  a bad value is an error naming the setting and the choices;
- Wire: pack/unpack/round in one C call each, the first overflow reported;
- fp32 is bit for bit what the exchange did before the setting existed: a fixed
  sequence of pulls and pushes (three tables, two row widths, Adagrad, Adam, SGD) gives
  the digest that main's exchange (fe2ada1) gave, in BSP and in SSP;
- fp16/bf16 on one rank: the rows a pull returns are the table's rows rounded to the
  wire, the owner applies the rounded gradients in float32 (equal to a table that
  applied them itself), and the table keeps float32 values;
- fp16's per-segment scale: values of any magnitude keep 11 bits relative to their
  segment's largest (numpy's float16 as the reference), no finite value overflows;
- a value that does not fit (a row or a gradient beyond bf16's range, near float32's
  largest) refuses the step with an error naming the table, the key and the fix, and
  changes nothing; fp16 takes the same values. The multi-rank cases are in
  tests/mpi/test_wire.py.
"""

import hashlib

import numpy as np
import pytest

from kvcoll import Config, InvalidArgumentError, NonFiniteError, optimizers, runtime
from kvcoll.comm import Comm
from kvcoll.config import BSP
from kvcoll.exchange import OK, Agreement, BspExchange, SspExchange, make_exchange
from kvcoll.exchange.bsp import group_key
from kvcoll.exchange.wire import Wire, wire_of
from kvcoll.step import Grads, Loop
from kvcoll.table import KvTable

# what main's exchange (commit fe2ada1, before the wire setting) gave for run_sequence,
# BSP and SSP alike (one rank, staleness 0)
DIGEST_BEFORE = "08bf9d0e80f0af46f2754e8f5e31aa27afe6ae4672b935245500f3f2a8d88fdd"


def sequence_tables():
    return {"a": KvTable(8, name="a", seed=5, optimizer=optimizers.Adagrad(0.1)),
            "b": KvTable(4, name="b", seed=6, optimizer=optimizers.Adam(0.01)),
            "c": KvTable(8, name="c", seed=7, optimizer=optimizers.SGD(0.5))}


def run_sequence(mode: str, wire_dtype=None) -> str:
    """Six steps of pulls and pushes on one rank; the digest of every pulled row and of
    every table's rows, slots and steps after them."""
    tabs = sequence_tables()
    comm = Comm.local()
    ex = BspExchange(comm, tabs, wire_dtype=wire_dtype) if mode == "bsp" \
        else SspExchange(comm, tabs, 0, wire_dtype=wire_dtype)
    rng = np.random.default_rng(1)
    h = hashlib.sha256()
    for _ in range(6):
        ids = {n: rng.integers(0, 300, 500 + 37 * i) for i, n in enumerate(tabs)}
        agreement = Agreement(10)
        pull = ex.pull(ids, agreement)
        for g in sorted(pull.rows):
            h.update(pull.rows[g].tobytes())
        grads = {g: (rng.standard_normal(m.shape) * 0.1).astype(np.float32)
                 for g, m in pull.rows.items()}
        agreement.report(OK)
        pushed = ex.push(pull, grads, None, np.zeros(1, np.float32), agreement)
        pushed.reduced()
        pushed.commit()
    if mode != "bsp":
        ex.finish()
    ex.close()
    for t in tabs.values():
        e = t.export()
        order = np.argsort(e["keys"])
        for k in ("keys", "values", "slots", "last_step"):
            h.update(np.ascontiguousarray(e[k][order]).tobytes())
        t.close()
    return h.hexdigest()


# -- the setting ------------------------------------------------------------------------

def test_the_setting_from_code_flag_or_environment(monkeypatch):
    monkeypatch.delenv("KVCOLL_WIRE_DTYPE", raising=False)
    assert Config().wire_dtype == "fp32"
    assert Config.resolve([], {"KVCOLL_WIRE_DTYPE": "bf16"}).wire_dtype == "bf16"
    assert Config.resolve(["--wire-dtype", "fp16"], {"KVCOLL_WIRE_DTYPE": "bf16"}
                          ).wire_dtype == "fp16"
    assert Config.resolve(["--wire-dtype=fp16"], {}, wire_dtype="bf16").wire_dtype == "bf16"
    assert wire_of("bf16") == Wire("bf16") and wire_of(Wire("fp16")).name == "fp16"
    assert wire_of(None).name == "fp32"   # the run's: no kv.init here, no variable


@pytest.mark.parametrize("make", [
    lambda: Config.resolve([], {"KVCOLL_WIRE_DTYPE": "float16"}),
    lambda: Config.resolve(["--wire-dtype", "half"], {}),
    lambda: Config.resolve([], {}, wire_dtype="int8"),
    lambda: Wire("fp8"),
    lambda: BspExchange(Comm.local(), {"a": KvTable(4, name="a")}, wire_dtype="FP16"),
])
def test_a_bad_value_names_the_setting_and_the_choices(make):
    with pytest.raises(InvalidArgumentError,
                       match=r"wire_dtype '.*' is unknown; use one of fp32, fp16, bf16 "
                             r"\(kv.init\(wire_dtype=...\), --wire-dtype, KVCOLL_WIRE_DTYPE\)"):
        make()


def test_the_run_setting_reaches_the_exchange(monkeypatch):
    tabs = {"a": KvTable(4, name="a")}
    # before kv.init: the environment's; after: the run's (kv.init's, read once)
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    monkeypatch.setenv("KVCOLL_WIRE_DTYPE", "bf16")
    assert make_exchange(Comm.local(), tabs, BSP).wire.name == "bf16"
    assert make_exchange(Comm.local(), tabs, BSP, wire_dtype="fp16").wire.name == "fp16"
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "config", lambda: Config(wire_dtype="fp16"))
    assert make_exchange(Comm.local(), tabs, BSP).wire.name == "fp16"
    tabs["a"].close()


# -- the conversions --------------------------------------------------------------------

def f16_reference(x: np.ndarray) -> np.ndarray:
    """x as one fp16 segment reads back, by numpy's float16 (round to nearest even):
    scaled by 2^k so that its largest finite magnitude lies in [2^14, 2^15)."""
    finite = np.abs(x[np.isfinite(x)])
    m = finite.max(initial=0)
    k = 0 if m == 0 else int(np.clip(14 - np.floor(np.log2(m)), -126, 126))
    scaled = (x * np.float32(2.0 ** k)).astype(np.float16).astype(np.float32)
    return (scaled * np.float32(2.0 ** -k)).astype(np.float32), k


def test_pack_unpack_round_and_the_first_overflow():
    x = np.array([1.0, 65504, 65519.99, -65520, 1e-8, 3e-8, np.inf, np.nan, 7e4], np.float32)
    f16 = Wire("fp16")
    packed, bad = f16.pack(x)
    assert packed.dtype == np.uint16 and packed.size == x.size + 1 and bad == -1
    want, k = f16_reference(x)
    assert packed[:1].view(np.int16)[0] == k == -2   # 7e4 * 2^-2 = 17500: below 2^15
    back, nonfinite = f16.unpack(packed)
    assert back.ctypes.data % 64 == 0 and nonfinite == 6
    np.testing.assert_array_equal(back, want)
    assert back[6] == np.inf and np.isnan(back[7]) and back[3] == -65536   # a tie: even
    # segments: each with its own scale; gradients of 1e-7 keep their bits
    g = (np.random.default_rng(0).standard_normal(1000) * 1e-6).astype(np.float32)
    rows = (np.random.default_rng(1).standard_normal(500) * 0.1).astype(np.float32)
    both = np.concatenate([g, rows])
    packed, bad = f16.pack(both, [1000, 0, 500])
    assert packed.size == 1502 and bad == -1 and list(f16.counts([1000, 0, 500])) == [1001, 0, 501]
    back, _ = f16.unpack(packed, [1000, 0, 500])
    np.testing.assert_array_equal(back[:1000], f16_reference(g)[0])
    np.testing.assert_array_equal(back[1000:], f16_reference(rows)[0])
    big = np.abs(g) > np.abs(g).max() / 1024
    assert (np.abs(back[:1000] - g)[big] <= np.abs(g)[big] * 2.0 ** -11).all()
    plain = g.astype(np.float16).astype(np.float32)   # fp16 without a scale
    assert (np.abs(plain - g)[big] > np.abs(g)[big] * 2.0 ** -11).mean() > 0.5
    bf = Wire("bf16")
    packed, bad = bf.pack(x)
    assert packed.size == x.size and bad == -1 and bf.unpack(packed)[1] == 6
    np.testing.assert_array_equal(bf.unpack(packed)[0][:4], [1.0, 65536, 65536, -65536])
    packed, bad = bf.pack(np.array([1.0, 3.4e38, -3.39e38], np.float32))
    assert bad == 1 and bf.unpack(packed)[0][1] == np.inf
    y = x[:6].copy()
    assert f16.round(y) == -1
    np.testing.assert_array_equal(y, f16_reference(x[:6])[0])
    fp32 = Wire("fp32")
    same, bad = fp32.pack(x)
    assert np.shares_memory(same, x) and bad == -1
    with pytest.raises(InvalidArgumentError, match="float32"):
        f16.pack(x.astype(np.float64))
    with pytest.raises(InvalidArgumentError, match="uint16"):
        f16.unpack(x)
    with pytest.raises(InvalidArgumentError, match="do not cut"):
        f16.pack(x, [3, 3])
    with pytest.raises(InvalidArgumentError, match="do not hold"):
        f16.unpack(np.zeros(5, np.uint16), [5])


# -- fp32: as before --------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_fp32_is_bit_identical_to_the_exchange_before_the_setting(mode, monkeypatch):
    monkeypatch.delenv("KVCOLL_WIRE_DTYPE", raising=False)
    assert run_sequence(mode, "fp32") == DIGEST_BEFORE
    assert run_sequence(mode) == DIGEST_BEFORE           # the default


@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_16_bit_wires_change_the_run_and_agree_between_modes(mode):
    got = {w: run_sequence(mode, w) for w in ("fp16", "bf16")}
    assert len({DIGEST_BEFORE, *got.values()}) == 3
    assert got == {w: run_sequence("bsp", w) for w in ("fp16", "bf16")}


# -- 16 bits on one rank: what the model reads, what the owner applies ------------------

DIM = 8
KEYS = np.arange(1000, 1300, dtype=np.int64)


def adagrad_table(name="a"):
    t = KvTable(DIM, name=name, seed=9, initializer=("uniform", -3.0, 3.0),
                optimizer=optimizers.Adagrad(0.3))
    t.find_or_create(KEYS, step=1)
    t.apply_gradients(KEYS, np.zeros((KEYS.size, DIM), np.float32), step=1)  # trained once
    return t


@pytest.mark.parametrize("wire_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_rows_are_rounded_and_the_owner_applies_rounded_gradients_in_float32(mode, wire_dtype):
    wire = Wire(wire_dtype)
    t, ref = adagrad_table(), adagrad_table()
    ex = BspExchange(Comm.local(), {"a": t}, wire_dtype=wire_dtype) if mode == "bsp" \
        else SspExchange(Comm.local(), {"a": t}, 0, wire_dtype=wire_dtype)
    ids = np.random.default_rng(3).choice(KEYS, 700)
    for step in (2, 3):
        agreement = Agreement(ids.size)
        pull = ex.pull({"a": ids}, agreement)
        uniq = pull["a"].uniq
        want = ref.find(uniq).astype(np.float32)
        wire.round(want)
        np.testing.assert_array_equal(pull["a"].rows, want)   # the table's, rounded
        g = (np.random.default_rng(step).standard_normal((uniq.size, DIM)) * 0.01
             ).astype(np.float32)
        agreement.report(OK)
        pushed = ex.push(pull, {"a": g}, None, np.zeros(1, np.float32), agreement)
        pushed.reduced()
        pushed.commit()
        rounded = g.copy()
        wire.round(rounded)
        ref.apply_gradients(uniq, rounded, step=step)
        got, exp = t.export(), ref.export()
        oa, ob = np.argsort(got["keys"]), np.argsort(exp["keys"])
        for k in ("keys", "values", "slots"):
            np.testing.assert_array_equal(got[k][oa], exp[k][ob], err_msg=k)
    values = t.export()["values"]
    assert values.dtype == np.float32
    as16 = values.copy()
    wire.round(as16)
    assert (as16 != values).mean() > 0.5     # the table keeps float32, not wire values
    assert ex.wire_bytes == {"ids": 0, "rows": 0, "grads": 0}   # one rank: nothing sent
    if mode != "bsp":
        ex.finish()
    ex.close()
    t.close()
    ref.close()


# -- values that do not fit -------------------------------------------------------------

def export_state(t):
    e = t.export()
    order = np.argsort(e["keys"])
    return {k: v[order] for k, v in e.items()}


@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_a_gradient_beyond_bf16_refuses_the_step_and_names_table_key_and_fix(mode):
    t = adagrad_table()
    ex = BspExchange(Comm.local(), {"a": t}, wire_dtype="bf16") if mode == "bsp" \
        else SspExchange(Comm.local(), {"a": t}, 0, wire_dtype="bf16")
    before = export_state(t)
    agreement = Agreement(3)
    pull = ex.pull({"a": KEYS[[4, 5, 6]]}, agreement)
    g = np.full((3, DIM), 0.5, np.float32)
    bad_key = int(pull["a"].uniq[1])
    g[1, 3] = -3.4e38
    agreement.report(OK)
    pushed = ex.push(pull, {"a": g}, None, np.zeros(1, np.float32), agreement)
    pushed.reduced()
    assert agreement.outcome_failed == [0]
    err = agreement.outcome_error
    assert isinstance(err, NonFiniteError)
    text = str(err)
    assert f"table 'a', key {bad_key}: a value of its row gradient is -3.4e+38" in text
    assert "beyond bf16's range" in text and "wire_dtype='fp16'" in text
    ex.abandon(pushed)
    after = export_state(t)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert ex.step == 0
    if mode != "bsp":
        ex.finish()
    ex.close()
    t.close()


def test_without_an_agreement_the_push_raises_it():
    t = adagrad_table()
    ex = BspExchange(Comm.local(), {"a": t}, wire_dtype="bf16")
    before = export_state(t)
    pull = ex.pull({"a": KEYS[:2]})
    g = np.zeros((2, DIM), np.float32)
    g[0, 0] = 3.4e38
    with pytest.raises(NonFiniteError, match=r"row gradient is 3.4e\+38, beyond bf16"):
        ex.push(pull, {"a": g}).commit()
    after = export_state(t)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    t.close()


class OneTableCompute:
    """p = sigmoid(sum of the id's row); SGD on nothing dense."""

    n_dense, dense_slots = 0, 0

    def __init__(self):
        self._state = np.zeros(2, np.float32)

    def prepare(self, element, x_only=False):
        ids, y = element

        class B:
            pass
        b = B()
        b.ids, b.y, b.n = np.asarray(ids, np.int64), np.asarray(y, np.float32), len(ids)
        return b

    def ids(self, batch):
        return {"a": batch.ids if batch is not None else np.zeros(0, np.int64)}

    def _p(self, batch, pull):
        rows = pull.rows[group_key(DIM)][pull.pos["a"]]
        return rows, 1 / (1 + np.exp(-rows.sum(1)))

    def train(self, batch, pull, weight):
        _, p = self._p(batch, pull)
        d = (p - batch.y) / batch.n * weight
        grow = np.zeros_like(pull.rows[group_key(DIM)])
        np.add.at(grow, pull.pos["a"], np.repeat(d[:, None], DIM, 1))
        loss = float(np.mean(np.abs(p - batch.y)))
        return Grads(loss, None, {group_key(DIM): grow},
                     self._state + [loss * batch.n, batch.n], bool(np.isfinite(grow).all()))

    def zero_grads(self, pull):
        return Grads(0.0, None, {g: np.zeros_like(m) for g, m in pull.rows.items()},
                     self._state)

    def evaluate(self, batch, pull):
        _, p = self._p(batch, pull)
        return self._state + [float(np.mean(p)) * batch.n, batch.n]

    def predict(self, batch, pull):
        return self._p(batch, pull)[1]

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

    def explain(self, batch):
        return None


@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_a_row_beyond_bf16_fails_the_step_evaluation_and_prediction(mode):
    t = adagrad_table()
    t.update(KEYS[7:8], np.full((1, DIM), 3.4e38, np.float32))
    before = export_state(t)
    ex = make_exchange(Comm.local(), {"a": t}, BSP if mode == "bsp" else Config(
        step_mode="ssp", staleness=0).mode, wire_dtype="bf16")
    loop = Loop(ex, OneTableCompute())
    batch = (KEYS[[3, 7, 9]], np.array([1, 0, 1], np.float32))
    msg = rf"step 1: table 'a', key {KEYS[7]}: a value of its row was beyond bf16's range"
    with pytest.raises(NonFiniteError, match=msg):
        loop.train(batch)
    after = export_state(t)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert loop.step == 0
    if mode == "bsp":
        with pytest.raises(NonFiniteError, match=f"key {KEYS[7]}: a value of its row"):
            loop.evaluate(batch)
        assert loop.predict(batch) == (True, None)      # told at the next step
        with pytest.raises(NonFiniteError, match=f"key {KEYS[7]}: a value of its row"):
            loop.predict(batch)
    loop.train((KEYS[[3, 9]], np.array([1, 0], np.float32)))  # rows that fit: it goes on
    assert loop.step == 1
    loop.close()
    t.close()


def test_fp16_takes_any_finite_value():
    t = adagrad_table()
    t.update(KEYS[7:8], np.full((1, DIM), 3.4e38, np.float32))
    ex = BspExchange(Comm.local(), {"a": t}, wire_dtype="fp16")
    pull = ex.pull({"a": KEYS[[3, 7, 9]]})
    rows = pull["a"].rows
    assert np.isfinite(rows).all()
    np.testing.assert_allclose(rows[list(pull["a"].uniq).index(KEYS[7])], 3.4e38, rtol=2 ** -11)
    g = np.zeros((3, DIM), np.float32)
    g[0] = 1e10                                   # and as a gradient: applied (Adagrad)
    ex.push(pull, {"a": g}).commit()
    assert np.isfinite(t.find(KEYS[[3, 7, 9]])).all()
    t.close()
    t.close()
