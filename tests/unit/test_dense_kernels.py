"""The C row kernels applied to plain float rows (SSP/ASP's dense slices), and the
Keras optimizer -> C kernel mapping the Trainer uses for them."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.keras.optimizer import dense_kernel  # noqa: E402
from kvcoll.exchange.dense import apply_rows, init_slots, slot_floats  # noqa: E402


@pytest.mark.parametrize("opt", [kv.optimizers.SGD(0.1), kv.optimizers.Adagrad(0.1),
                                 kv.optimizers.Adam(0.01)], ids=["sgd", "adagrad", "adam"])
def test_apply_rows_equals_the_table_kernel(opt):
    dim, g = 6, np.random.default_rng(1).normal(size=(3, 6)).astype(np.float32)
    t = kv.KvTable(dim, name="t", initializer=("uniform", -1, 1), optimizer=opt)
    keys = np.array([1, 2, 3])
    w = t.find_or_create(keys).copy()
    slots = init_slots(opt, dim, 3)
    assert slots.shape == (3, slot_floats(opt, dim))
    for step in (1, 2):
        t.apply_gradients(keys, g * step, step=step)
        apply_rows(opt, w, slots, g * step, step)
    np.testing.assert_array_equal(w, t.find(keys))
    np.testing.assert_array_equal(slots, t.export()["slots"][np.argsort(t.export()["keys"])])
    t.close()


def test_apply_rows_rejects_bad_input_unchanged():
    opt = kv.optimizers.Adam(0.01)
    w, s = np.ones((1, 4), np.float32), init_slots(opt, 4)
    before = (w.copy(), s.copy())
    with pytest.raises(kv.NonFiniteError):
        apply_rows(opt, w, s, np.array([[1, np.nan, 0, 0]], np.float32), 1)
    with pytest.raises(kv.DimensionError):
        apply_rows(opt, w, s, np.ones((1, 3), np.float32), 1)
    with pytest.raises(kv.InvalidArgumentError, match="slots"):
        apply_rows(opt, w, s[:, :-1].copy(), np.ones((1, 4), np.float32), 1)
    with pytest.raises(kv.InvalidArgumentError, match="step"):
        apply_rows(opt, w, s, np.ones((1, 4), np.float32), 0)
    np.testing.assert_array_equal(w, before[0])
    np.testing.assert_array_equal(s, before[1])


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.99),
                                  lambda: keras.optimizers.SGD(0.1),
                                  lambda: keras.optimizers.Adagrad(0.1, epsilon=1e-10),
                                  lambda: keras.optimizers.Adagrad(0.1, epsilon=0.5)],
                         ids=["adam", "sgd", "adagrad", "adagrad-large-epsilon"])
def test_keras_optimizer_maps_to_the_matching_kernel(make):
    """Three updates of a dense vector: the C kernel agrees with the Keras optimizer."""
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=8).astype(np.float32)
    grads = [rng.normal(size=8).astype(np.float32) for _ in range(3)]
    ko = make()
    v = keras.Variable(w0)
    for g in grads:
        ko.apply_gradients([(keras.ops.convert_to_tensor(g), v)])
    row = dense_kernel(make())
    w, s = w0.reshape(1, -1).copy(), init_slots(row, 8)
    for step, g in enumerate(grads, 1):
        apply_rows(row, w, s, g.reshape(1, -1), step)
    np.testing.assert_allclose(w[0], np.asarray(v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt,match", [
    (lambda: keras.optimizers.RMSprop(0.01), "RMSprop: ssp/asp update dense parameters"),
    (lambda: keras.optimizers.SGD(0.01, momentum=0.9), "no C kernel for momentum"),
    (lambda: keras.optimizers.Adam(0.01, amsgrad=True), "no C kernel for amsgrad"),
    (lambda: keras.optimizers.Adam(0.01, clipnorm=1.0), "no C kernel for clipnorm"),
])
def test_optimizers_without_a_kernel_are_refused(opt, match):
    with pytest.raises(kv.InvalidArgumentError, match=match):
        dense_kernel(opt())


def test_a_scheduled_learning_rate_is_taken_at_the_step():
    """SSP/ASP pass the dense kernel the Keras schedule's rate at the worker's step."""
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    opt = keras.optimizers.Adam(sched)
    assert dense_kernel(opt).learning_rate == pytest.approx(0.1)
    assert dense_kernel(opt, learning_rate=0.025).learning_rate == pytest.approx(0.025)
