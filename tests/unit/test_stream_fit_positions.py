"""The data position a checkpoint records for a stream trained with
model.fit(stream.dataset(), steps_per_epoch=N): the position after exactly the steps
taken, however many epochs they span (the stream's pass goes on across epochs: Keras
keeps the iterator when steps_per_epoch is given) and however many empty batches the
stream yielded while it waited for files (they move no position). A stream resumed
there reads exactly the rows not trained on: none twice, none skipped.

And whether the epoch a stop or a preemption ended counts as complete: only when it came
with the end of every rank's data.
"""

import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402
from kvcoll.keras.model import progress_of  # noqa: E402

keras = tf.keras
B, ROWS = 16, 64          # 4 batches a file
FAST = {"settle": 0.02, "idle_poll": 0.05}


def land(root, k):
    rows = np.arange(k * ROWS, (k + 1) * ROWS, dtype=np.int64)
    table = pa.table({"row": rows, "click": (rows % 3 == 0).astype(np.int8)})
    tmp = os.path.join(root, f"part-{k}.parquet.tmp")
    pq.write_table(table, tmp)
    os.rename(tmp, os.path.join(root, f"part-{k}.parquet"))


def stream(root, **kw):
    return kv.data.stream(os.path.join(root, "*.parquet"), B, 0, 1, label="click",
                          categorical=["row"], **FAST, **kw)


def model():
    keras.utils.set_random_seed(0)
    x = keras.Input(shape=(), dtype="int64", name="row")
    m = kv.Model({"row": x}, keras.layers.Dense(1)(kv.Embedding("t", 2)(x)))
    engine_of(m, comm=Comm.local())
    m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return m


def rows_after(root, position):
    """The rows a stream resumed at `position` reads before it runs dry."""
    s = stream(root, idle_timeout=0.3)
    s.resume(position)
    return np.concatenate([b["categorical"]["row"] for b in s] or [np.zeros(0, np.int64)])


def test_the_position_spans_epochs(tmp_path):
    root = str(tmp_path)
    for k in range(3):                      # 12 batches
        land(root, k)
    m = model()
    m.fit(stream(root, idle_timeout=None).dataset(), steps_per_epoch=5, epochs=2, verbose=0)
    assert engine_of(m).step == 10
    pos = progress_of(m)["position"]
    np.testing.assert_array_equal(rows_after(root, pos), np.arange(10 * B, 3 * ROWS))


def test_empty_batches_while_idle_move_no_position(tmp_path):
    root = str(tmp_path)
    land(root, 0)                           # 4 batches now, 4 more in a second
    later = threading.Timer(1.0, land, (root, 1))
    later.start()
    try:
        m = model()
        t0 = time.monotonic()
        m.fit(stream(root, idle_timeout=None).dataset(), steps_per_epoch=6, epochs=1,
              verbose=0)
        assert time.monotonic() - t0 >= 0.9  # it waited for the second file
    finally:
        later.join()
    assert engine_of(m).step == 6
    pos = progress_of(m)["position"]
    np.testing.assert_array_equal(rows_after(root, pos), np.arange(6 * B, 2 * ROWS))


class _StopAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


def _batches(n):
    """n batches of B rows, from a generator: a pass of unknown length."""
    for k in range(n):
        rows = np.arange(k * B, (k + 1) * B, dtype=np.int64)
        yield {"row": rows}, (rows % 3 == 0).astype(np.float32)


def test_a_stop_at_the_last_step_of_a_pass_completes_the_epoch():
    """The stop is agreed at the step that finds every rank's data at its end: the epoch
    is complete, so a resume begins the next one rather than a second pass of this."""
    m = model()
    m.fit(_batches(4), epochs=3, verbose=0, callbacks=[_StopAt(3)])
    assert engine_of(m).step == 4
    p = progress_of(m)
    assert (p["epoch"], p["step"], p["complete"]) == (0, 4, True)


def test_a_stop_while_a_stream_waits_leaves_the_epoch_incomplete(tmp_path):
    """A stream caught up is not at its end: stopped there, a resume waits for its next
    file."""
    root = str(tmp_path)
    land(root, 0)
    m = model()
    m.fit(stream(root, idle_timeout=0.3).dataset(), epochs=3, verbose=0,
          callbacks=[_StopAt(3)])
    p = progress_of(m)
    assert (p["epoch"], p["step"], p["complete"]) == (0, 4, False)
    land(root, 1)
    np.testing.assert_array_equal(rows_after(root, p["position"]), np.arange(ROWS, 2 * ROWS))


def test_a_stop_before_the_last_step_leaves_the_epoch_incomplete(tmp_path):
    root = str(tmp_path)
    land(root, 0)
    m = model()
    m.fit(stream(root, idle_timeout=0.3).dataset(), epochs=3, verbose=0,
          callbacks=[_StopAt(1)])
    p = progress_of(m)
    assert (p["epoch"], p["step"], p["complete"]) == (0, 2, False)
    np.testing.assert_array_equal(rows_after(root, p["position"]), np.arange(2 * B, ROWS))


def test_a_preemption_before_fit_stops_it_at_once(tmp_path):
    """SIGTERM (or kvcollrun's SIGUSR2) that came before fit, say during a restore: fit
    takes no step and returns preempted, as if it had come during the first step."""
    from kvcoll import runtime
    root = str(tmp_path)
    land(root, 0)
    m = model()
    runtime.note_preempted()
    try:
        history = m.fit(stream(root, idle_timeout=0.3).dataset(), epochs=2, verbose=0)
    finally:
        runtime._preempted.clear()
    assert engine_of(m).step == 0
    assert history.preempted
