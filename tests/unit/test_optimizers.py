"""The row optimizers, through KvTable, against their published rules.

Every optimizer runs several steps of random batches with duplicate keys and with
rows missing from some steps, and after every step the whole table (values and
slots) is compared with
  (a) a few lines of numpy (float64) that state the rule, and
  (b) for SGD, Adagrad, Adam and FTRL, TensorFlow's own kernels (float32) fed the
      same per-step unique ids and summed gradients.
Group Adam and Group Adagrad follow TFPlus's kernels (see csrc/kv_optim.c); they are
also checked against TensorFlow in the settings where they reduce to Adam and FTRL.
Row-wise Adagrad follows FBGEMM's EXACT_ROWWISE_ADAGRAD: its published rule in float64,
its CPU kernel's float32 operation order bit for bit, and FBGEMM itself, bit for bit,
where the peers bench's TorchRec venv (with fbgemm_gpu) is present.
Keras 3's variants (Adagrad with epsilon inside the sqrt, Ftrl's beta) are checked
against Keras 3's own optimizers, and learning rates that change between steps
(KvTable.set_learning_rate, schedules) against the numpy rules with the same rates.
"""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoll import errors
from kvcoll import optimizers as opt
from kvcoll.table import KvTable

DIM = 8
N_KEYS = 40
STEPS = 6
RTOL = 2e-5
ATOL = 2e-6


# ---- data --------------------------------------------------------------------------


def make_keys(seed: int, n: int = N_KEYS) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keys = rng.choice(np.arange(-(2**40), 2**40, 2**30 + 7), size=n, replace=False)
    return np.sort(keys.astype(np.int64))


def make_batches(seed: int, keys: np.ndarray, dim: int = DIM, steps: int = STEPS,
                 row_scale=None):
    """Per step: a shuffled batch where each present key appears 1-3 times (so the
    table must sum duplicates) and about 40% of keys are absent (lazy updates)."""
    rng = np.random.default_rng(seed)
    scale = np.ones(len(keys)) if row_scale is None else np.asarray(row_scale)
    out = []
    for t in range(1, steps + 1):
        present = np.flatnonzero(rng.random(len(keys)) < 0.6)
        rep = rng.integers(1, 4, size=present.size)
        idx = np.repeat(present, rep)
        rng.shuffle(idx)
        grads = (rng.normal(size=(idx.size, dim)) * scale[idx, None]).astype(np.float32)
        out.append((t, keys[idx], grads))
    return out


def summed(keys: np.ndarray, batch_keys: np.ndarray, grads: np.ndarray, dtype):
    """Unique row indices present in the batch and their summed gradients."""
    idx = np.searchsorted(keys, batch_keys)
    uniq = np.unique(idx)
    g = np.zeros((len(keys), grads.shape[1]), dtype)
    np.add.at(g, idx, grads.astype(dtype))
    return uniq, g[uniq]


def new_table(optimizer, w0: np.ndarray, keys: np.ndarray) -> KvTable:
    t = KvTable(w0.shape[1], optimizer=optimizer, initializer="zeros", seed=0, name="t")
    t.update(keys, w0)
    return t


def snapshot(t: KvTable, keys: np.ndarray, optimizer) -> dict:
    """Values and named slots of `keys` (in that order), from one export."""
    e = t.export()
    order = np.argsort(e["keys"])
    pos = order[np.searchsorted(e["keys"], keys, sorter=order)]
    np.testing.assert_array_equal(e["keys"][pos], keys)
    out = {"w": e["values"][pos]}
    slots, at = e["slots"][pos], 0
    for name, width in optimizer._slot_layout(t.dim):
        block = np.ascontiguousarray(slots[:, at:at + width])
        out[name] = block.view(np.uint32)[:, 0] if name == "step" else block
        at += width
    assert at == slots.shape[1], "slot layout and slot count disagree"
    return out


def assert_state(got: dict, want: dict, what: str, rtol=RTOL, atol=ATOL, skip=()):
    """Equal steps; floats close, with atol relative to the array's largest entry
    (float32 rounds a slot's small entries at the scale of its terms: `linear`
    accumulates O(w / learning_rate))."""
    for name, value in want.items():
        if name in skip:
            continue
        if name == "step":
            np.testing.assert_array_equal(got[name], value, err_msg=f"{what}: {name}")
        else:
            scale = max(1.0, float(np.max(np.abs(value)))) if value.size else 1.0
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol * scale,
                                       err_msg=f"{what}: {name}")


# ---- numpy statements of the rules (float64) ----------------------------------------


class F32:
    """An optimizer's hyperparameters as the table stores them (rounded to float32;
    beta_2 = 0.999 is 0.99900001 there, which TF's kernels see too)."""

    def __init__(self, o):
        self._o = o

    def __getattr__(self, name):
        value = getattr(self._o, name)
        return float(np.float32(value)) if isinstance(value, float) else value


class NumpyRef:
    """State of every key; `step` updates only the rows present (lazy).

    dtype float64 states the rule exactly; float32 evaluates the same rule at the
    precision TF's kernels work in (used where float32 cancellation, e.g. in
    sqrt(accum + g^2) - sqrt(accum) for g^2 << accum, would swamp the comparison)."""

    def __init__(self, o, w0, dtype=np.float64):
        self.o, self.rule, n, d = F32(o), type(o).__name__.lower(), w0.shape[0], w0.shape[1]
        self.dtype = dtype
        self.lr = float(np.float32(o.learning_rate_at(0)))  # set per step for a schedule
        self.s = {"w": w0.astype(dtype)}
        for name, width in o._slot_layout(d):
            self.s[name] = (np.zeros(n, np.int64) if name == "step"
                            else np.zeros((n, width), dtype))
        if "accum" in self.s:
            self.s["accum"][:] = self.o.initial_accumulator_value
        if isinstance(o, opt.GroupAdam):
            self.s["v"][:] = self.o.initial_accumulator_value

    def step(self, rows, g, t):
        s = {k: v[rows] for k, v in self.s.items()}
        getattr(self, self.rule)(s, g, t)
        for k, v in s.items():
            self.s[k][rows] = v

    def _t(self, s, t):
        if "step" in s:
            s["step"] += 1
            if self.o.per_row_step:
                return s["step"][:, None].astype(self.dtype)
        return float(t)

    def sgd(self, s, g, t):
        s["w"] -= self.lr * g

    def adagrad(self, s, g, t):
        o = self.o
        s["accum"] += g * g
        if o.epsilon_inside_sqrt:  # Keras 3
            s["w"] -= self.lr * g / np.sqrt(s["accum"] + o.epsilon)
        else:  # TensorFlow's kernel
            s["w"] -= self.lr * g / (np.sqrt(s["accum"]) + o.epsilon)

    def adam(self, s, g, t):
        o, t = self.o, self._t(s, t)
        s["m"] = o.beta_1 * s["m"] + (1 - o.beta_1) * g
        s["v"] = o.beta_2 * s["v"] + (1 - o.beta_2) * g * g
        lr_t = self.lr * np.sqrt(1 - o.beta_2**t) / (1 - o.beta_1**t)
        s["w"] -= lr_t * s["m"] / (np.sqrt(s["v"]) + o.epsilon)

    def ftrl(self, s, g, t):
        o, w = self.o, s["w"]
        p, lr = -o.learning_rate_power, self.lr
        l2 = o.l2_regularization_strength + o.beta / (2 * lr)  # Keras' beta
        gs = g + 2 * o.l2_shrinkage_regularization_strength * w
        acc = s["accum"] + g * g
        s["linear"] += gs - (acc**p - s["accum"] ** p) / lr * w
        lin, l1 = s["linear"], o.l1_regularization_strength
        s["w"] = (np.clip(lin, -l1, l1) - lin) / (acc**p / lr + 2 * l2)
        s["accum"] = acc

    def groupadam(self, s, g, t):
        # TFPlus GroupAdam, kernel version 4 (KvVariableGroupSparseApplyAdamV4).
        o, t = self.o, self._t(s, t)
        lr, w = self.lr, s["w"]
        l1, l2, l21 = (lr * o.l1_regularization_strength, lr * o.l2_regularization_strength,
                       lr * o.l21_regularization_strength)
        b1p = o.beta1**t
        alpha = lr * np.sqrt(1 - o.beta2**t) / (1 - b1p)
        s["m"] = o.beta1 * s["m"] + (1 - o.beta1) * g
        v_new = o.beta2 * s["v"] + (1 - o.beta2) * g * g
        sigma = np.where(o.beta1 > b1p, np.sqrt(v_new) - np.sqrt(s["v"]),
                         np.sqrt(v_new) + o.epsilon)
        s["linear"] += alpha * s["m"] - sigma * w
        s["w"] = group_lasso(s["linear"], l1, l21, np.sqrt(v_new) + o.epsilon + 2 * l2)
        s["v"] = v_new

    def groupadagrad(self, s, g, t):
        # TFPlus SparseGroupFtrl (KvVariableSparseGroupSparseApplyFtrlV2).
        o, w = self.o, s["w"]
        p, lr = -o.learning_rate_power, self.lr
        gs = g + 2 * o.l2_shrinkage_regularization_strength * w
        acc = s["accum"] + gs * gs
        s["linear"] += gs - (acc**p - s["accum"] ** p) / lr * w
        s["w"] = group_lasso(s["linear"], o.l1_regularization_strength,
                             o.l21_regularization_strength,
                             acc**p / lr + 2 * o.l2_regularization_strength)
        s["accum"] = acc


    def rowwiseadagrad(self, s, g, t):
        # FBGEMM EXACT_ROWWISE_ADAGRAD (fbgemm_gpu codegen/genscript/optimizers.py,
        # rowwise_adagrad): one accumulator per row fed the mean of g'^2 over the row.
        o, w = self.o, s["w"]
        wd, mode = o.weight_decay, o.weight_decay_mode
        gp = g + wd * w if mode == "l2" else g
        s["accum"] += np.mean(gp * gp, axis=1, keepdims=True)
        m = self.lr / (np.sqrt(s["accum"]) + o.epsilon)
        c = 1 - m * wd if mode == "l2" else (1 - self.lr * wd if mode == "decoupled" else 1.0)
        s["w"] = c * w - m * g


def group_lasso(linear, l1, l21, denom):
    """Sparse group lasso proximal step of TFPlus: l1-shrink each component, then
    shrink the row's norm by l21 * sqrt(dim); rows under the threshold become 0."""
    u = np.clip(linear, -l1, l1) - linear
    norm = np.linalg.norm(u, axis=1, keepdims=True)
    thr = l21 * np.sqrt(linear.shape[1])
    keep = norm > thr
    shrink = np.where(keep, 1 - thr / np.where(keep, norm, 1), 0.0)
    return u * shrink / denom


def run_vs_numpy(o, keys, w0, batches, rtol=RTOL, atol=ATOL, dtype=np.float64, skip=()):
    """With a scheduled optimizer, the table and the rule both use learning_rate_at(
    step - 1) at step `step` (steps count from 1, Keras' iterations from 0)."""
    ref = NumpyRef(o, w0, dtype)
    with new_table(o, w0, keys) as t:
        assert_state(snapshot(t, keys, o), ref.s, "initial")
        for step, bkeys, grads in batches:
            if o.is_scheduled:
                t.set_learning_rate(o.learning_rate_at(step - 1))
                ref.lr = float(np.float32(o.learning_rate_at(step - 1)))
            t.apply_gradients(bkeys, grads, step=step)
            rows, g = summed(keys, bkeys, grads, dtype)
            ref.step(rows, g, step)
            assert_state(snapshot(t, keys, o), ref.s, f"step {step}", rtol, atol, skip)
        return snapshot(t, keys, o), ref


# ---- TensorFlow's kernels (float32) ------------------------------------------------


class TfRef:
    """The same optimizer run by TensorFlow's raw kernels on [N_KEYS, dim] variables."""

    def __init__(self, tf, o, w0):
        self.tf, self.o = tf, o
        d = w0.shape[1]
        self.s = {"w": tf.Variable(w0)}
        for name, _width in o._slot_layout(d):
            if name != "step":
                init = o.initial_accumulator_value if name == "accum" else 0.0
                self.s[name] = tf.Variable(np.full(w0.shape, init, np.float32))
        self.count = np.zeros(w0.shape[0], np.int64)

    def numpy(self):
        out = {k: v.numpy() for k, v in self.s.items()}
        if "m" in out:
            out["step"] = self.count.astype(np.uint32)
        return out

    def step(self, rows, g, t):
        tf, o, s = self.tf, self.o, self.s
        self.count[rows] += 1
        idx = tf.constant(rows, tf.int64)
        f = np.float32
        if isinstance(o, opt.Adagrad):
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=s["w"].handle, accum=s["accum"].handle, lr=f(o.learning_rate),
                epsilon=f(o.epsilon), grad=g, indices=idx, update_slots=True)
        elif isinstance(o, opt.Ftrl):
            tf.raw_ops.ResourceSparseApplyFtrlV2(
                var=s["w"].handle, accum=s["accum"].handle, linear=s["linear"].handle,
                grad=g, indices=idx, lr=f(o.learning_rate),
                l1=f(o.l1_regularization_strength),
                # Keras 2 passes its beta to this kernel the same way
                l2=f(o.l2_regularization_strength) + f(o.beta) / (2 * f(o.learning_rate)),
                l2_shrinkage=f(o.l2_shrinkage_regularization_strength),
                lr_power=f(o.learning_rate_power))
        else:  # dense kernels on the gathered rows, scattered back
            names = ["w", "m", "v"] if isinstance(o, opt.Adam) else ["w"]
            tmp = {k: tf.Variable(tf.gather(s[k], idx)) for k in names}
            if isinstance(o, opt.Adam):
                tt = self.count[rows][0] if o.per_row_step else t
                assert not o.per_row_step or np.all(self.count[rows] == tt)
                tf.raw_ops.ResourceApplyAdam(
                    var=tmp["w"].handle, m=tmp["m"].handle, v=tmp["v"].handle,
                    beta1_power=f(o.beta_1) ** f(tt), beta2_power=f(o.beta_2) ** f(tt),
                    lr=f(o.learning_rate), beta1=f(o.beta_1), beta2=f(o.beta_2),
                    epsilon=f(o.epsilon), grad=g)
            else:
                tf.raw_ops.ResourceApplyGradientDescent(
                    var=tmp["w"].handle, alpha=f(o.learning_rate), delta=g)
            for k in names:
                s[k].scatter_update(tf.IndexedSlices(tmp[k].value(), idx))


@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("tensorflow")


def run_vs_tf(tf, o, keys, w0, batches):
    ref = TfRef(tf, o, w0)
    with new_table(o, w0, keys) as t:
        for step, bkeys, grads in batches:
            t.apply_gradients(bkeys, grads, step=step)
            rows, g = summed(keys, bkeys, grads, np.float32)
            ref.step(rows, g, step)
            assert_state(snapshot(t, keys, o), ref.numpy(), f"step {step} vs TensorFlow")


# ---- the batches really exercise duplicates and laziness -----------------------------


def test_batches_have_duplicates_and_absent_rows():
    keys = make_keys(0)
    batches = make_batches(1, keys)
    seen = np.zeros(len(keys), int)
    for _, bkeys, _ in batches:
        assert len(np.unique(bkeys)) < len(bkeys)           # duplicates in every step
        present = np.isin(keys, bkeys)
        assert 0 < present.sum() < len(keys)                # some rows absent
        seen += present
    assert ((seen > 0) & (seen < len(batches))).sum() > N_KEYS // 2  # touched, then not


# ---- SGD, Adagrad, Adam, FTRL ------------------------------------------------------

TF_CASES = {
    "sgd": opt.SGD(0.1),
    "adagrad": opt.Adagrad(0.1),
    "adagrad_zero_acc": opt.Adagrad(0.05, initial_accumulator_value=0.0, epsilon=1e-3),
    "adam": opt.Adam(0.01),
    "adam_betas": opt.Adam(0.02, beta_1=0.5, beta_2=0.8, epsilon=1e-4),
    "ftrl": opt.Ftrl(0.1),
    "ftrl_l1_l2": opt.Ftrl(0.2, l1_regularization_strength=0.3,
                           l2_regularization_strength=0.1),
    "ftrl_shrinkage_power": opt.Ftrl(0.1, learning_rate_power=-0.7,
                                     initial_accumulator_value=0.5,
                                     l1_regularization_strength=0.05,
                                     l2_regularization_strength=0.02,
                                     l2_shrinkage_regularization_strength=0.1),
    "ftrl_power_zero": opt.Ftrl(0.05, learning_rate_power=0.0,
                                l1_regularization_strength=0.01),
    "ftrl_beta": opt.Ftrl(0.1, l1_regularization_strength=0.05,
                          l2_regularization_strength=0.02, beta=0.3),
}
# No TensorFlow kernel divides by sqrt(accum + epsilon): checked against Keras 3 below.
KERAS3_CASES = {
    "adagrad_eps_inside": opt.Adagrad(0.1, epsilon_inside_sqrt=True),
    "adagrad_eps_inside_small_acc": opt.Adagrad(0.05, initial_accumulator_value=0.001,
                                                epsilon=1e-3, epsilon_inside_sqrt=True),
}


@pytest.mark.parametrize("case", sorted(TF_CASES) + sorted(KERAS3_CASES))
def test_matches_numpy_rule(case):
    keys = make_keys(2)
    w0 = np.random.default_rng(3).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    run_vs_numpy({**TF_CASES, **KERAS3_CASES}[case], keys, w0, make_batches(4, keys))


@pytest.mark.parametrize("case", sorted(TF_CASES))
def test_matches_tensorflow_kernels(tf, case):
    keys = make_keys(5)
    w0 = np.random.default_rng(6).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    run_vs_tf(tf, TF_CASES[case], keys, w0, make_batches(7, keys))


def test_dim_one_matches_tensorflow(tf):
    # TF takes a scalar code path when the row width is 1.
    keys = make_keys(8)
    w0 = np.random.default_rng(9).uniform(-0.5, 0.5, (N_KEYS, 1)).astype(np.float32)
    for o in (opt.Adagrad(0.1), opt.Ftrl(0.1, l1_regularization_strength=0.1)):
        run_vs_tf(tf, o, keys, w0, make_batches(10, keys, dim=1))


def test_adam_per_row_step_counts_each_row():
    keys = make_keys(11)
    w0 = np.random.default_rng(12).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(13, keys)
    o = opt.Adam(0.01, per_row_step=True)
    state, _ = run_vs_numpy(o, keys, w0, batches)
    expect = sum(np.isin(keys, b) for _, b, _ in batches)
    np.testing.assert_array_equal(state["step"], expect)
    # per_row_step changes the result only where a row missed steps
    glob, _ = run_vs_numpy(opt.Adam(0.01), keys, w0, batches)
    np.testing.assert_array_equal(glob["step"], expect)  # counted either way
    always = expect == len(batches)
    np.testing.assert_allclose(state["w"][always], glob["w"][always], rtol=1e-6)
    assert not np.allclose(state["w"][~always], glob["w"][~always])


def test_adam_per_row_step_matches_tensorflow_per_row(tf):
    # One row at a time, so each TF call gets that row's own beta powers.
    keys = make_keys(14, n=6)
    w0 = np.random.default_rng(15).uniform(-0.5, 0.5, (6, DIM)).astype(np.float32)
    o = opt.Adam(0.03, per_row_step=True)
    ref = TfRef(tf, o, w0)
    rng = np.random.default_rng(16)
    with new_table(o, w0, keys) as t:
        for step in range(1, 8):
            row = int(rng.integers(0, 6))
            g = rng.normal(size=(1, DIM)).astype(np.float32)
            t.apply_gradients(keys[[row, row]], np.concatenate([g / 2, g / 2]), step=step)
            ref.step(np.array([row]), g, step)
            assert_state(snapshot(t, keys, o), ref.numpy(), f"step {step}")


# ---- Group Adam and Group Adagrad (TFPlus) ----------------------------------------------

ROW_SCALE = np.geomspace(1e-3, 2.0, N_KEYS)  # small-gradient rows are the ones to prune

GROUP_CASES = {
    "group_adam": opt.GroupAdam(0.05, l1_regularization_strength=0.01,
                                l2_regularization_strength=0.01,
                                l21_regularization_strength=0.1),
    "group_adam_per_row": opt.GroupAdam(0.05, beta1=0.8, beta2=0.9, epsilon=1e-6,
                                        initial_accumulator_value=0.01,
                                        l1_regularization_strength=0.02,
                                        l21_regularization_strength=0.6,
                                        per_row_step=True),
    "group_adagrad": opt.GroupAdagrad(0.1, l1_regularization_strength=0.01,
                                      l2_regularization_strength=0.01,
                                      l21_regularization_strength=0.05),
    "group_adagrad_power_shrinkage": opt.GroupAdagrad(
        0.1, learning_rate_power=-0.6, initial_accumulator_value=0.2,
        l1_regularization_strength=0.02, l21_regularization_strength=0.05,
        l2_shrinkage_regularization_strength=0.05),
}


@pytest.mark.parametrize("case", sorted(GROUP_CASES))
def test_group_matches_numpy_rule_and_prunes_exactly(case):
    o = GROUP_CASES[case]
    keys = make_keys(20)
    w0 = np.random.default_rng(21).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(22, keys, row_scale=ROW_SCALE)
    state, ref = run_vs_numpy(o, keys, w0, batches)
    zero_ref = np.all(ref.s["w"] == 0, axis=1)
    touched = np.isin(keys, np.concatenate([b for _, b, _ in batches]))
    # the case is informative: some touched rows pruned, some kept
    assert zero_ref[touched].any() and not zero_ref[touched].all()
    # pruned rows read as exact +0.0f (export and find agree), kept rows do not
    assert np.all(state["w"][zero_ref].view(np.uint32) == 0)
    assert np.all(np.any(state["w"][touched & ~zero_ref] != 0, axis=1))
    np.testing.assert_array_equal(_run_and_find(o, keys, w0, batches), state["w"])


def _run_and_find(o, keys, w0, batches):
    """The same run, read back with find() instead of export()."""
    with new_table(o, w0, keys) as t:
        for step, bkeys, grads in batches:
            t.apply_gradients(bkeys, grads, step=step)
        return t.find(keys)


@pytest.mark.parametrize("make", [
    lambda l21: opt.GroupAdam(0.05, l21_regularization_strength=l21),
    lambda l21: opt.GroupAdagrad(0.1, l21_regularization_strength=l21),
], ids=["group_adam", "group_adagrad"])
def test_large_l21_zeroes_every_touched_row_and_only_those(make):
    o = make(1e4)
    keys = make_keys(23)
    w0 = np.random.default_rng(24).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(25, keys)
    with new_table(o, w0, keys) as t:
        touched = np.zeros(N_KEYS, bool)
        for step, bkeys, grads in batches:
            t.apply_gradients(bkeys, grads, step=step)
            touched |= np.isin(keys, bkeys)
            rows = t.find(keys)
            assert np.all(rows[touched].view(np.uint32) == 0)
            np.testing.assert_array_equal(rows[~touched], w0[~touched])
        assert not touched.all()
    # and the same data with l21 = 0 leaves every touched row non-zero
    state, _ = run_vs_numpy(make(0.0), keys, w0, batches)
    assert np.all(np.any(state["w"][touched] != 0, axis=1))


@pytest.mark.parametrize("dim", [1, 4, 16, 64])
def test_group_threshold_scales_with_sqrt_dim(dim):
    # One Group Adagrad step from w = 0 with l1 = 0: linear = g, so the row survives
    # iff ||g|| > l21 * sqrt(dim). A constant row of c has ||g|| = c sqrt(dim).
    l21 = 0.5
    keys = np.array([1, 2], np.int64)
    g = np.full((2, dim), [[l21 * 1.2], [l21 * 0.8]], np.float32)
    o = opt.GroupAdagrad(0.1, l21_regularization_strength=l21)
    with new_table(o, np.zeros((2, dim), np.float32), keys) as t:
        t.apply_gradients(keys, g, step=1)
        rows = t.find(keys)
    assert np.all(rows[0] != 0) and np.all(rows[1].view(np.uint32) == 0)
    # the kept row is shrunk by (1 - thr/||g||), as the group-lasso rule says
    expect = -g[0] * (1 - 1 / 1.2) / (np.sqrt(0.1 + g[0] ** 2) / 0.1)
    np.testing.assert_allclose(rows[0], expect, rtol=1e-5)


def test_group_adam_scales_regularization_by_learning_rate():
    # Group Adam (TFPlus v4) compares the norm with l21 * lr * sqrt(dim): a first step
    # from w = 0 gives linear = alpha * (1 - beta1) g with alpha = lr sqrt(1-b2)/(1-b1).
    lr, dim = 0.5, 16
    o0 = opt.GroupAdam(lr, l21_regularization_strength=0.0)
    alpha = lr * np.sqrt(1 - 0.999) / (1 - 0.9)
    c = 0.3  # norm of linear = alpha * 0.1 * c * sqrt(dim)
    l21_edge = alpha * 0.1 * c / lr
    keys = np.array([1], np.int64)
    g = np.full((1, dim), c, np.float32)
    for factor, zero in ((0.98, False), (1.02, True)):
        o = opt.GroupAdam(lr, l21_regularization_strength=l21_edge * factor)
        with new_table(o, np.zeros((1, dim), np.float32), keys) as t:
            t.apply_gradients(keys, g, step=1)
            row = t.find(keys)[0]
        assert np.all(row == 0) == zero, (factor, row)
    with new_table(o0, np.zeros((1, dim), np.float32), keys) as t:
        t.apply_gradients(keys, g, step=1)
        assert np.all(t.find(keys) != 0)


def test_group_adagrad_without_group_terms_is_tensorflow_ftrl(tf):
    # l21 = 0 and no shrinkage: TFPlus's sparse group FTRL is FTRL, row for row.
    keys = make_keys(26)
    w0 = np.random.default_rng(27).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(28, keys)
    for power in (-0.5, -0.7):
        g_o = opt.GroupAdagrad(0.1, learning_rate_power=power, l1_regularization_strength=0.2,
                               l2_regularization_strength=0.05)
        f_o = opt.Ftrl(0.1, learning_rate_power=power, l1_regularization_strength=0.2,
                       l2_regularization_strength=0.05)
        ref = TfRef(tf, f_o, w0)
        with new_table(g_o, w0, keys) as t:
            for step, bkeys, grads in batches:
                t.apply_gradients(bkeys, grads, step=step)
                rows, g = summed(keys, bkeys, grads, np.float32)
                ref.step(rows, g, step)
                assert_state(snapshot(t, keys, g_o), ref.numpy(), f"step {step}")


def test_group_adam_without_regularization_is_tensorflow_adam(tf):
    # With l1 = l2 = l21 = 0 Group Adam is Adam when each row's first update takes
    # TFPlus's first-step branch: rows starting at 0, or per-row steps.
    keys = make_keys(29)
    batches = make_batches(30, keys)
    w0 = np.zeros((N_KEYS, DIM), np.float32)
    g_o = opt.GroupAdam(0.01, epsilon=1e-7)
    ref = TfRef(tf, opt.Adam(0.01, epsilon=1e-7), w0)
    with new_table(g_o, w0, keys) as t:
        for step, bkeys, grads in batches:
            t.apply_gradients(bkeys, grads, step=step)
            rows, g = summed(keys, bkeys, grads, np.float32)
            ref.step(rows, g, step)
            got = snapshot(t, keys, g_o)
            want = ref.numpy()
            assert_state({k: got[k] for k in ("w", "m", "v", "step")},
                         {k: want[k] for k in ("w", "m", "v", "step")}, f"step {step}",
                         rtol=1e-4, atol=1e-6)


def test_group_adam_per_row_step_equals_adam_per_row_step():
    keys = make_keys(31)
    w0 = np.random.default_rng(32).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(33, keys)
    g_state, _ = run_vs_numpy(opt.GroupAdam(0.01, epsilon=1e-6, per_row_step=True),
                              keys, w0, batches)
    a_state, _ = run_vs_numpy(opt.Adam(0.01, epsilon=1e-6, per_row_step=True),
                              keys, w0, batches)
    for k in ("w", "m", "v", "step"):
        np.testing.assert_allclose(g_state[k], a_state[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_group_adam_global_step_first_update_quirk():
    # TFPlus decides "first step" from the global beta1 power, not per row: a row first
    # updated at step 3 takes the regular branch, which shrinks a non-zero starting
    # value by sqrt(v) / (sqrt(v) + epsilon). Large epsilon makes it visible.
    keys = np.array([7], np.int64)
    w0 = np.full((1, 4), 0.5, np.float32)
    g = np.full((1, 4), 0.1, np.float32)
    results = {}
    for per_row in (False, True):
        o = opt.GroupAdam(0.01, epsilon=0.1, per_row_step=per_row)
        with new_table(o, w0, keys) as t:
            t.apply_gradients(keys, g, step=3)
            results[per_row] = t.find(keys)[0]
    sq = np.sqrt(0.001 * 0.01)
    adam_like = 0.5 - 0.01 * np.sqrt(1 - 0.999) / (1 - 0.9) * 0.01 / (sq + 0.1)  # t = 1
    np.testing.assert_allclose(results[True], adam_like, rtol=1e-5)
    b1p = 0.9**3
    lin = 0.01 * np.sqrt(1 - 0.999**3) / (1 - b1p) * 0.01 - sq * 0.5
    np.testing.assert_allclose(results[False], -lin / (sq + 0.1), rtol=1e-5)


# ---- Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) -------------------------------

ROWWISE_CASES = {
    "rowwise": opt.RowWiseAdagrad(0.1),
    "rowwise_acc_eps": opt.RowWiseAdagrad(0.05, initial_accumulator_value=0.1, epsilon=1e-3),
    "rowwise_l2": opt.RowWiseAdagrad(0.1, weight_decay=0.05, weight_decay_mode="l2"),
    "rowwise_decoupled": opt.RowWiseAdagrad(0.2, initial_accumulator_value=0.01,
                                            weight_decay=0.1, weight_decay_mode="decoupled"),
}


@pytest.mark.parametrize("case", sorted(ROWWISE_CASES))
def test_rowwise_adagrad_matches_numpy_rule(case):
    o = ROWWISE_CASES[case]
    keys = make_keys(60)
    w0 = np.random.default_rng(61).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    state, _ = run_vs_numpy(o, keys, w0, make_batches(62, keys))
    assert state["accum"].shape == (N_KEYS, 1)          # one float per row


def fbgemm_cpu_rowwise(o, w, accum, g, lr):
    """FBGEMM's CPU kernel for row-wise Adagrad (the JIT GenerateSparseAdaGrad(rowwise)
    that fbgemm_gpu runs for float tables; rowwise_sparse_adagrad_ref states it), on the
    rows of w, in float32 and its operation order: element d's square into partial sum
    d mod 8, the 8 sums reduced pairwise, divided by D, added to the accumulator; then
    m = lr / (sqrt(accum) + eps) and w + g * (-m); and fbgemm_gpu's weight-decay modes
    (correction * w - g * m). Returns (w, accum)."""
    f = np.float32
    w, accum, g = w.astype(f), accum.astype(f).reshape(-1), g.astype(f)
    wd, lr, eps = f(o.weight_decay), f(lr), f(o.epsilon)
    part = np.zeros((8, w.shape[0]), f)
    for d in range(w.shape[1]):
        gd = g[:, d] + wd * w[:, d] if o.weight_decay_mode == "l2" else g[:, d]
        part[d % 8] = part[d % 8] + gd * gd
    sumsq = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) +
                                                          (part[6] + part[7]))
    accum = accum + sumsq / f(w.shape[1])
    m = lr / (np.sqrt(accum) + eps)
    if o.weight_decay_mode == "l2":
        w = (f(1.0) - m * wd)[:, None] * w - g * m[:, None]
    elif o.weight_decay_mode == "decoupled":
        w = (f(1.0) - lr * wd) * w - g * m[:, None]
    else:
        w = w + g * (-m)[:, None]
    return w, accum[:, None]


@pytest.mark.parametrize("case", sorted(ROWWISE_CASES))
@pytest.mark.parametrize("dim", [1, 7, 16, 64])
def test_rowwise_adagrad_is_fbgemms_cpu_arithmetic_bit_for_bit(case, dim):
    o = ROWWISE_CASES[case]
    keys = make_keys(63)
    w0 = np.random.default_rng(64).uniform(-0.5, 0.5, (N_KEYS, dim)).astype(np.float32)
    w, accum = w0.copy(), np.full((N_KEYS, 1), np.float32(o.initial_accumulator_value))
    with new_table(o, w0, keys) as t:
        for step, bkeys, grads in make_batches(65, keys, dim=dim):
            t.apply_gradients(bkeys, grads, step=step)
            rows, g = summed(keys, bkeys, grads, np.float32)
            w[rows], accum[rows] = fbgemm_cpu_rowwise(o, w[rows], accum[rows], g,
                                                      o.learning_rate_at(0))
            got = snapshot(t, keys, o)
            np.testing.assert_array_equal(got["w"], w, err_msg=f"step {step}")
            np.testing.assert_array_equal(got["accum"], accum, err_msg=f"step {step}")


def test_rowwise_adagrad_keeps_one_float_per_row():
    # 4 bytes of optimizer state per row against Adagrad's 4 * dim: a row in the arena
    # is 4 * (dim - 1) bytes smaller
    keys = np.arange(100, dtype=np.int64)
    for dim in (1, 16, 128):
        w0 = np.zeros((100, dim), np.float32)
        with new_table(opt.RowWiseAdagrad(0.1), w0, keys) as r, \
                new_table(opt.Adagrad(0.1), w0, keys) as a:
            assert (r.slot_floats, a.slot_floats) == (1, dim)
            assert a.stats().row_bytes - r.stats().row_bytes == 4 * (dim - 1)


def test_rowwise_adagrad_with_dim_one_is_adagrad():
    keys = make_keys(66)
    w0 = np.random.default_rng(67).uniform(-0.5, 0.5, (N_KEYS, 1)).astype(np.float32)
    batches = make_batches(68, keys, dim=1)
    r, _ = run_vs_numpy(opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7),
                        keys, w0, batches)
    a, _ = run_vs_numpy(opt.Adagrad(0.1), keys, w0, batches)
    np.testing.assert_array_equal(r["accum"], a["accum"])
    np.testing.assert_allclose(r["w"], a["w"], rtol=1e-6)


def test_rowwise_adagrad_moves_a_row_with_one_step_size():
    # Adagrad scales each float by its own history; row-wise by the row's: a row whose
    # first float always gets 10x the gradient of the others moves every float by the
    # same multiple of its gradient.
    keys = np.array([1], np.int64)
    g = np.array([[10.0, 1.0, 1.0, 1.0]], np.float32)
    for o, same in ((opt.RowWiseAdagrad(0.1), True), (opt.Adagrad(0.1), False)):
        with new_table(o, np.zeros((1, 4), np.float32), keys) as t:
            t.apply_gradients(keys, g, step=1)
            ratio = t.find(keys)[0] / -g[0]
        assert np.allclose(ratio, ratio[0], rtol=1e-6) == same, (o, ratio)


def test_rowwise_adagrad_is_refused_for_dense_slices():
    # SSP/ASP's dense slices are cut where the ranks split the dense vector: one
    # accumulator per "row" there would change the rule with the world size
    from kvcoll.exchange import dense

    w = np.zeros((1, 8), np.float32)
    for call in (lambda o: dense.slot_floats(o, 8), lambda o: dense.init_slots(o, 8),
                 lambda o: dense.apply_rows(o, w, np.zeros((1, 1), np.float32), w, 1)):
        with pytest.raises(errors.InvalidArgumentError, match="RowWiseAdagrad.*dense"):
            call(opt.RowWiseAdagrad(0.1))
    np.testing.assert_array_equal(w, 0)


def _fbgemm_python():
    """The peers bench's TorchRec venv's Python (it has fbgemm_gpu), if it is built."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", ".venv-peers", "torchrec",
                        "bin", "python")
    return path if os.path.exists(path) else None


_FBGEMM_SCRIPT = r"""
import json, sys
import numpy as np, torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen, WeightDecayMode)
a = json.load(sys.stdin)
w0, steps = np.array(a["w0"], np.float32), a["steps"]
mode = {"none": WeightDecayMode.NONE, "l2": WeightDecayMode.L2,
        "decoupled": WeightDecayMode.DECOUPLE}[a["mode"]]
emb = SplitTableBatchedEmbeddingBagsCodegen(
    [(w0.shape[0], w0.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU)],
    optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=a["lr"], eps=a["eps"],
    weight_decay=a["wd"], weight_decay_mode=mode)
emb.split_embedding_weights()[0].data.copy_(torch.from_numpy(w0))
emb.split_optimizer_states()[0][0].fill_(a["acc0"])
for rows, g in steps:
    idx = torch.tensor(rows, dtype=torch.int64)
    out = emb(idx, torch.arange(len(rows) + 1, dtype=torch.int64))
    out.backward(torch.tensor(g, dtype=torch.float32))
print(json.dumps({"w": emb.split_embedding_weights()[0].tolist(),
                  "accum": emb.split_optimizer_states()[0][0].tolist()}))
"""


@pytest.mark.skipif(_fbgemm_python() is None,
                    reason="FBGEMM runs in the peers bench's TorchRec venv (.venv-peers/"
                           "torchrec: python -m bench peers builds it)")
@pytest.mark.parametrize("case", ["rowwise", "rowwise_acc_eps"])
def test_rowwise_adagrad_is_fbgemm_bit_for_bit(case):
    """The same rows, gradients and steps through FBGEMM's own CPU kernel
    (fbgemm_gpu's SplitTableBatchedEmbeddingBagsCodegen, EXACT_ROWWISE_ADAGRAD, float
    weights on the host: what TorchRec runs on CPU), one distinct id per bag so that
    each row gets its summed gradient once a step, as kvcoll's tables do: the same bits.
    Without weight decay only: fbgemm_gpu's CPU path hands that kernel a weight decay
    of 0, whatever the mode (in 1.8.0, L2 and DECOUPLE give the rows of NONE there)."""
    import json
    import subprocess

    o = ROWWISE_CASES[case]
    keys = make_keys(69)
    w0 = np.random.default_rng(70).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    steps = []
    with new_table(o, w0, keys) as t:
        for step, bkeys, grads in make_batches(71, keys):
            t.apply_gradients(bkeys, grads, step=step)
            rows, g = summed(keys, bkeys, grads, np.float32)
            steps.append((rows.tolist(), g.tolist()))
        got = snapshot(t, keys, o)
    args = {"w0": w0.tolist(), "steps": steps, "lr": o.learning_rate, "eps": o.epsilon,
            "wd": o.weight_decay, "mode": o.weight_decay_mode,
            "acc0": o.initial_accumulator_value}
    proc = subprocess.run([_fbgemm_python(), "-c", _FBGEMM_SCRIPT], input=json.dumps(args),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_array_equal(got["w"], np.array(want["w"], np.float32))
    np.testing.assert_array_equal(got["accum"][:, 0], np.array(want["accum"], np.float32))


# ---- property test: random hyperparameters against the numpy rules ----------------


def _optimizers():
    lr = st.floats(1e-3, 1.0)
    acc = st.floats(0.01, 1.0)
    reg = st.one_of(st.just(0.0), st.floats(1e-4, 0.5))
    power = st.one_of(st.just(-0.5), st.floats(-1.0, 0.0))
    decay = st.floats(0.0, 0.99)
    return st.one_of(
        st.builds(opt.SGD, lr),
        st.builds(opt.Adagrad, lr, acc, st.floats(0.0, 1e-3), st.booleans()),
        st.builds(opt.Adam, lr, decay, st.floats(0.5, 0.999), st.floats(1e-8, 1e-3),
                  st.booleans()),
        st.builds(opt.Ftrl, lr, power, acc, reg, reg, reg, reg),
        # l21 = 0 keeps the comparison away from the prune/keep boundary
        st.builds(opt.GroupAdam, lr, st.floats(0.0, 0.1), decay, st.floats(0.5, 0.999),
                  st.floats(1e-8, 1e-3), reg, reg, st.just(0.0), st.booleans()),
        st.builds(opt.GroupAdagrad, lr, power, acc, reg, reg, st.just(0.0), reg),
        st.builds(opt.RowWiseAdagrad, lr, acc, st.floats(0.0, 1e-3), reg,
                  st.sampled_from(["l2", "decoupled"])),
        st.builds(opt.RowWiseAdagrad, lr, acc, st.floats(0.0, 1e-3)),
    )


@settings(max_examples=60, deadline=None)
@given(o=_optimizers(), dim=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2**32 - 1),
       log_scale=st.floats(-2.0, 1.0))
def test_property_random_hyperparameters(o, dim, seed, log_scale):
    keys = make_keys(seed, n=12)
    rng = np.random.default_rng(seed)
    w0 = rng.uniform(-0.5, 0.5, (12, dim)).astype(np.float32)
    batches = [(t, k, g * np.float32(10.0**log_scale))
               for t, k, g in make_batches(seed + 1, keys, dim=dim, steps=4)]
    # `linear` is left out: with a small learning rate it is a float32 difference of
    # terms O(w / lr) (e.g. (accum'^p - accum^p) / lr * w with g^2 << accum), where
    # one ulp of accum^p is a large absolute error; TF's kernel rounds the same way.
    # It cannot hide a bug: every rule that keeps `linear` recomputes w from it.
    run_vs_numpy(o, keys, w0, batches, rtol=1e-4, atol=1e-5, dtype=np.float32,
                 skip=("linear",))


# ---- initial slots and validation -------------------------------------------------

ALL_DEFAULTS = [opt.SGD(0.1), opt.Adagrad(0.1), opt.Adam(0.1), opt.Ftrl(0.1),
                opt.GroupAdam(0.1), opt.GroupAdagrad(0.1), opt.RowWiseAdagrad(0.1)]


@pytest.mark.parametrize("o", ALL_DEFAULTS, ids=lambda o: type(o).__name__)
def test_defaults_are_accepted_and_slots_start_at_initial_state(o):
    keys = np.array([3, -5], np.int64)
    w0 = np.ones((2, 5), np.float32)
    with new_table(o, w0, keys) as t:
        s = snapshot(t, keys, o)
    assert_state(s, NumpyRef(o, w0).s, "initial", rtol=1e-7, atol=0)
    assert o._c_fields()["kind"] in ("sgd", "adagrad", "adam", "ftrl", "group_adam",
                                     "group_adagrad", "rowwise_adagrad")


def test_keras_and_tfplus_defaults():
    assert opt.Adagrad(0.1) == opt.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7,
                                           epsilon_inside_sqrt=False)
    assert opt.Adam(0.1) == opt.Adam(0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7)
    assert opt.Ftrl(0.1) == opt.Ftrl(0.1, -0.5, 0.1, 0.0, 0.0, 0.0, 0.0)
    assert opt.GroupAdam(0.1) == opt.GroupAdam(0.1, 0.0, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0)
    assert opt.GroupAdagrad(0.1) == opt.GroupAdagrad(0.1, -0.5, 0.1, 0.0, 0.0, 0.0, 0.0)
    # FBGEMM's: accumulators from 0, eps 1e-8, no weight decay (what TorchRec passes)
    assert opt.RowWiseAdagrad(0.1) == opt.RowWiseAdagrad(0.1, 0.0, 1e-8, 0.0, "none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.Adam(0.1).learning_rate = 1.0


BAD = [
    (opt.SGD, {"learning_rate": 0.0}, "learning_rate"),
    (opt.SGD, {"learning_rate": -1.0}, "learning_rate"),
    (opt.SGD, {"learning_rate": float("nan")}, "learning_rate"),
    (opt.SGD, {"learning_rate": 1e-60}, "learning_rate"),  # 0 in float32
    (opt.SGD, {"learning_rate": "0.1"}, "learning_rate"),
    (opt.Adagrad, {"learning_rate": 0.1, "initial_accumulator_value": -0.1},
     "initial_accumulator_value"),
    (opt.Adagrad, {"learning_rate": 0.1, "epsilon": -1e-7}, "epsilon"),
    (opt.Adagrad, {"learning_rate": 0.1, "epsilon_inside_sqrt": 1}, "epsilon_inside_sqrt"),
    (opt.Adam, {"learning_rate": -0.5}, "learning_rate"),
    (opt.Adam, {"learning_rate": float("inf")}, "learning_rate"),
    (opt.Adam, {"learning_rate": None}, "learning_rate"),
    (opt.Ftrl, {"learning_rate": lambda step: -1.0}, "learning_rate"),
    (opt.Ftrl, {"learning_rate": lambda step: float("nan")}, "learning_rate"),
    (opt.Adam, {"learning_rate": 0.1, "beta_1": 1.0}, "beta_1"),
    (opt.Adam, {"learning_rate": 0.1, "beta_2": -0.1}, "beta_2"),
    (opt.Adam, {"learning_rate": 0.1, "beta_2": 0.99999999}, "beta_2"),  # 1 in float32
    (opt.Adam, {"learning_rate": 0.1, "epsilon": float("inf")}, "epsilon"),
    (opt.Adam, {"learning_rate": 0.1, "per_row_step": 1}, "per_row_step"),
    (opt.Ftrl, {"learning_rate": 0.1, "learning_rate_power": 0.5}, "learning_rate_power"),
    (opt.Ftrl, {"learning_rate": 0.1, "l1_regularization_strength": -1.0},
     "l1_regularization_strength"),
    (opt.Ftrl, {"learning_rate": 0.1, "l2_regularization_strength": -1.0},
     "l2_regularization_strength"),
    (opt.Ftrl, {"learning_rate": 0.1, "l2_shrinkage_regularization_strength": -1.0},
     "l2_shrinkage_regularization_strength"),
    (opt.Ftrl, {"learning_rate": 0.1, "beta": -0.1}, "beta"),
    (opt.Ftrl, {"learning_rate": 0.1, "beta": float("nan")}, "beta"),
    (opt.GroupAdam, {"learning_rate": 0.1, "beta1": 1.5}, "beta1"),
    (opt.GroupAdam, {"learning_rate": 0.1, "l21_regularization_strength": -0.1},
     "l21_regularization_strength"),
    (opt.GroupAdam, {"learning_rate": 0.1, "initial_accumulator_value": -1.0},
     "initial_accumulator_value"),
    (opt.GroupAdagrad, {"learning_rate": 0.0}, "learning_rate"),
    (opt.GroupAdagrad, {"learning_rate": 0.1, "learning_rate_power": 1.0},
     "learning_rate_power"),
    (opt.GroupAdagrad, {"learning_rate": 0.1, "l21_regularization_strength": -0.1},
     "l21_regularization_strength"),
    (opt.GroupAdagrad, {"learning_rate": 0.1, "l2_shrinkage_regularization_strength": -1},
     "l2_shrinkage_regularization_strength"),
    (opt.RowWiseAdagrad, {"learning_rate": 0.0}, "learning_rate"),
    (opt.RowWiseAdagrad, {"learning_rate": 0.1, "epsilon": -1e-8}, "epsilon"),
    (opt.RowWiseAdagrad, {"learning_rate": 0.1, "initial_accumulator_value": -1.0},
     "initial_accumulator_value"),
    (opt.RowWiseAdagrad, {"learning_rate": 0.1, "weight_decay": -0.1}, "weight_decay"),
    (opt.RowWiseAdagrad, {"learning_rate": 0.1, "weight_decay_mode": "L2"},
     "weight_decay_mode"),
    (opt.RowWiseAdagrad, {"learning_rate": 0.1, "weight_decay": 0.1}, "weight_decay_mode"),
]


@pytest.mark.parametrize("cls,kwargs,field", BAD,
                         ids=[f"{c.__name__}-{f}-{i}" for i, (c, _, f) in enumerate(BAD)])
def test_invalid_hyperparameters_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b") as info:
        cls(**kwargs)
    assert cls.__name__ in str(info.value)


# ---- learning rates that change during training -------------------------------------

# One rate per step (index = Keras' iteration, step - 1), up and down by 15x.
RATES = [0.1, 0.03, 0.2, 0.013, 0.07, 0.3]


def rate_of(step: int) -> float:
    return RATES[step]


SCHEDULED_CASES = {
    "sgd": opt.SGD(rate_of),
    "adagrad": opt.Adagrad(rate_of),
    "adagrad_eps_inside": opt.Adagrad(rate_of, initial_accumulator_value=0.01,
                                      epsilon=1e-3, epsilon_inside_sqrt=True),
    "adam": opt.Adam(rate_of),
    "adam_per_row_step": opt.Adam(rate_of, beta_1=0.5, per_row_step=True),
    "ftrl_beta": opt.Ftrl(rate_of, l1_regularization_strength=0.05,
                          l2_regularization_strength=0.02, beta=0.3),
    "ftrl_beta_shrinkage_power": opt.Ftrl(rate_of, learning_rate_power=-0.7, beta=1.0,
                                          l2_shrinkage_regularization_strength=0.1),
    "group_adam": opt.GroupAdam(rate_of, l1_regularization_strength=0.01,
                                l21_regularization_strength=0.1),
    "group_adagrad": opt.GroupAdagrad(rate_of, l1_regularization_strength=0.01,
                                      l21_regularization_strength=0.05),
    "rowwise_adagrad_decoupled": opt.RowWiseAdagrad(rate_of, weight_decay=0.1,
                                                    weight_decay_mode="decoupled"),
}


@pytest.mark.parametrize("case", sorted(SCHEDULED_CASES))
def test_changing_learning_rate_matches_numpy_rule(case):
    # run_vs_numpy sets table and rule to learning_rate_at(step - 1) before each step
    o = SCHEDULED_CASES[case]
    assert o.is_scheduled
    keys = make_keys(40)
    w0 = np.random.default_rng(41).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(42, keys, steps=len(RATES))
    changed, _ = run_vs_numpy(o, keys, w0, batches)
    # the rates made a difference: the same run at the first rate throughout differs
    fixed, _ = run_vs_numpy(dataclasses.replace(o, learning_rate=RATES[0]), keys, w0,
                            batches)
    assert not np.allclose(changed["w"], fixed["w"], rtol=1e-3, atol=1e-4)


def test_changing_learning_rate_matches_tensorflow_kernels(tf):
    # TF's kernels take the rate per call; Ftrl's beta goes into l2 as Keras 2 does
    keys = make_keys(43)
    w0 = np.random.default_rng(44).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = make_batches(45, keys, steps=len(RATES))
    for o in (opt.Adagrad(rate_of), opt.Adam(rate_of),
              opt.Ftrl(rate_of, l1_regularization_strength=0.05, beta=0.3)):
        with new_table(o, w0, keys) as t:
            ref = None
            for step, bkeys, grads in batches:
                fixed = dataclasses.replace(o, learning_rate=o.learning_rate_at(step - 1))
                if ref is None:
                    ref = TfRef(tf, fixed, w0)
                ref.o = fixed
                t.set_learning_rate(fixed.learning_rate)
                t.apply_gradients(bkeys, grads, step=step)
                rows, g = summed(keys, bkeys, grads, np.float32)
                ref.step(rows, g, step)
                assert_state(snapshot(t, keys, o), ref.numpy(),
                             f"{type(o).__name__} step {step} vs TensorFlow")


def test_set_learning_rate_changes_nothing_else():
    o = opt.Adam(0.01)
    keys = make_keys(46)
    w0 = np.random.default_rng(47).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    with new_table(o, w0, keys) as t:
        assert t.learning_rate == 0.01
        _, bkeys, grads = make_batches(48, keys, steps=1)[0]
        t.apply_gradients(bkeys, grads, step=1)
        before = t.export()
        t.set_learning_rate(0.5)
        assert t.learning_rate == 0.5
        t.set_learning_rate(0.5)  # the current one: a no-op
        t.set_learning_rate(np.float32(0.25))
        assert t.learning_rate == 0.25
        after = t.export()
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        assert t.optimizer == o  # the table's optimizer object is unchanged


@pytest.mark.parametrize("bad,words", [
    (0.0, "> 0"), (-0.1, "> 0"), (1e-60, "> 0"), (float("nan"), "finite"),
    (float("inf"), "finite"), ("0.1", "number"), (None, "number"), (True, "number"),
])
def test_set_learning_rate_rejects_bad_values(bad, words):
    with new_table(opt.Adagrad(0.1), np.ones((2, 3), np.float32), np.array([1, 2])) as t:
        with pytest.raises(errors.InvalidArgumentError, match="learning_rate") as info:
            t.set_learning_rate(bad)
        assert "'t'" in str(info.value) and words in str(info.value)
        assert t.learning_rate == 0.1
        t.apply_gradients(np.array([1]), np.ones((1, 3), np.float32), step=1)
        np.testing.assert_allclose(t.find(np.array([1]))[0], 1 - 0.1 / np.sqrt(1.1),
                                   rtol=1e-6)  # still at 0.1
    with pytest.raises(errors.ClosedError):
        t.set_learning_rate(0.2)


def test_table_starts_at_the_schedules_first_rate():
    o = opt.Ftrl(lambda step: 0.5 / (1 + step), beta=0.1)
    with KvTable(3, optimizer=o, name="f") as t:
        assert t.learning_rate == 0.5 == o.learning_rate_at(0)
    assert o._c_fields()["lr"] == 0.5


# ---- schedules ---------------------------------------------------------------------


def test_schedule_function_learning_rate_at():
    def halve_every_10(step):
        return 0.2 * 0.5 ** (step // 10)

    o = opt.Adagrad(halve_every_10, epsilon_inside_sqrt=True)
    assert o.is_scheduled and not opt.Adagrad(0.2).is_scheduled
    assert [o.learning_rate_at(s) for s in (0, 9, 10, 25)] == [0.2, 0.2, 0.1, 0.05]
    assert opt.SGD(0.3).learning_rate_at(12345) == 0.3
    assert isinstance(opt.SGD(np.float32(0.5)).learning_rate_at(0), float)
    assert o.learning_rate_at(np.int64(20)) == 0.05
    # a scheduled optimizer stays a frozen, comparable, printable dataclass
    assert o == opt.Adagrad(halve_every_10, epsilon_inside_sqrt=True)
    assert o != opt.Adagrad(lambda step: 0.2, epsilon_inside_sqrt=True)
    assert "halve_every_10" in repr(o)
    assert hash(o) == hash(opt.Adagrad(halve_every_10, epsilon_inside_sqrt=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.learning_rate = 0.1


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None])
def test_learning_rate_at_rejects_bad_steps(step):
    for o in (opt.SGD(0.1), opt.SGD(rate_of)):
        with pytest.raises(errors.InvalidArgumentError, match="SGD: step"):
            o.learning_rate_at(step)


@pytest.mark.parametrize("value,words", [
    (-1.0, "got -1.0"), (0.0, "got 0.0"), (float("nan"), "finite"), (float("inf"), "finite"),
    ("fast", "number"), (np.array([0.1, 0.2]), "number"),
])
def test_schedule_bad_value_names_optimizer_step_and_value(value, words):
    o = opt.Adam(lambda step: value if step == 7 else 0.01)  # fine at step 0
    assert o.learning_rate_at(6) == 0.01
    with pytest.raises(errors.InvalidArgumentError) as info:
        o.learning_rate_at(7)
    msg = str(info.value)
    assert msg.startswith("Adam: learning_rate at step 7") and words in msg, msg
    # the same schedule failing at step 0 fails when the optimizer is built
    with pytest.raises(errors.InvalidArgumentError, match="Adam: learning_rate at step 0"):
        opt.Adam(lambda step: value)


@pytest.fixture(scope="module")
def keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip("Keras 3 is the reference here")
    return keras


def test_keras_schedule_learning_rate_at(keras):
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    o = opt.Ftrl(sched, beta=0.2)
    assert o.is_scheduled
    for step in (0, 1, 10, 15, 1000):
        got = o.learning_rate_at(step)
        assert type(got) is float
        assert got == pytest.approx(0.1 * 0.5 ** (step / 10), rel=1e-6)
    stair = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True)
    assert opt.SGD(stair).learning_rate_at(19) == pytest.approx(0.05, rel=1e-6)
    piece = keras.optimizers.schedules.PiecewiseConstantDecay([5], [0.1, -0.1])
    with pytest.raises(errors.InvalidArgumentError, match="SGD: learning_rate at step 6"):
        opt.SGD(piece).learning_rate_at(6)
    assert "ExponentialDecay" in repr(o) and o == opt.Ftrl(sched, beta=0.2)


# ---- against Keras 3's own optimizers -----------------------------------------------------


def _dense_batches(seed, keys, steps=8, dim=DIM):
    """Every key in every step (once or twice): Keras updates every row of a dense
    variable each step, so only dense gradients compare like for like."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(1, steps + 1):
        idx = np.concatenate([np.arange(len(keys)), rng.choice(len(keys), len(keys) // 2)])
        rng.shuffle(idx)
        out.append((t, keys[idx], rng.normal(size=(idx.size, dim)).astype(np.float32)))
    return out


def run_vs_keras(keras, o, k_opt, keys, w0, batches):
    """max |kvcoll - Keras| / max(1, |Keras|) over every step."""
    var = keras.Variable(w0)
    worst = 0.0
    with new_table(o, w0, keys) as t:
        for step, bkeys, grads in batches:
            # Keras evaluates a schedule at its iterations: 0 at the first update
            assert int(k_opt.iterations.numpy()) == step - 1
            t.set_learning_rate(o.learning_rate_at(step - 1))
            t.apply_gradients(bkeys, grads, step=step)
            _, g = summed(keys, bkeys, grads, np.float32)
            k_opt.apply_gradients([(keras.ops.convert_to_tensor(g), var)])
            want = keras.ops.convert_to_numpy(var)
            worst = max(worst, float(np.max(np.abs(t.find(keys) - want)
                                             / np.maximum(1.0, np.abs(want)))))
    return worst


KERAS_TOL = 1e-5


# Keras 3's class name: (keyword arguments for both, kvcoll's option, the kvcoll rule
# without it, which must NOT match: the comparison can fail).
KERAS3_OPTIONS = {
    "Adagrad": (dict(initial_accumulator_value=1e-3, epsilon=1e-2),  # the rules differ
                dict(epsilon_inside_sqrt=True), dict(epsilon_inside_sqrt=False)),
    "Ftrl": (dict(learning_rate_power=-0.5, initial_accumulator_value=0.1,
                  l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                  l2_shrinkage_regularization_strength=0.05, beta=0.5),
             {}, dict(beta=0.0)),
}


@pytest.mark.parametrize("scheduled", [False, True], ids=["constant", "schedule"])
@pytest.mark.parametrize("name", sorted(KERAS3_OPTIONS))
def test_keras3_options_match_keras3(keras, name, scheduled):
    # Adagrad(epsilon_inside_sqrt=True) and Ftrl(beta=...) against keras.optimizers'
    # Adagrad and Ftrl on a dense variable, with a constant rate and with a schedule
    # (which Ftrl's beta / (2 lr) must follow)
    kw, ours, without = KERAS3_OPTIONS[name]
    lr = (keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=2, decay_rate=0.3)
          if scheduled else 0.2)
    keys = make_keys(50)
    w0 = np.random.default_rng(51).uniform(-0.5, 0.5, (N_KEYS, DIM)).astype(np.float32)
    batches = _dense_batches(52, keys)
    ours_cls, keras_cls = getattr(opt, name), getattr(keras.optimizers, name)
    err = run_vs_keras(keras, ours_cls(lr, **kw, **ours), keras_cls(lr, **kw), keys, w0,
                       batches)
    assert err <= KERAS_TOL
    err_without = run_vs_keras(keras, ours_cls(lr, **{**kw, **without}), keras_cls(lr, **kw),
                               keys, w0, batches)
    assert err_without > 100 * KERAS_TOL
