"""model.fit(stream.dataset(), steps_per_epoch=N) at any world size, with a file that
lands while the ranks wait: the position a checkpoint records (progress_of) on each
rank is the one after exactly the batches that rank trained on, across epochs and
however many empty batches it read while waiting. A stream resumed there reads the
rest of the rank's rows and nothing else: the rows it trained on plus the rows it
resumes with are its whole part of every file, in order, none twice.
"""

import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

import kvcoll as kv  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402
from kvcoll.keras.model import progress_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

B, ROWS = 24, 96          # 4 global batches a file
FAST = {"settle": 0.05, "idle_poll": 0.05}


def land(root, k):
    rows = np.arange(k * ROWS, (k + 1) * ROWS, dtype=np.int64)
    table = pa.table({"row": rows, "click": (rows % 3 == 0).astype(np.int8)})
    tmp = os.path.join(root, f".part-{k}.parquet.inprogress")
    pq.write_table(table, tmp, row_group_size=ROWS // 4)
    os.rename(tmp, os.path.join(root, f"part-{k}.parquet"))


def stream(root, **kw):
    return kv.data.stream(os.path.join(root, "*.parquet"), B, label="click",
                          categorical=["row"], **FAST, **kw)


def rows_of(s):
    return np.concatenate([b["categorical"]["row"] for b in s] or [np.zeros(0, np.int64)])


class Count(keras.callbacks.Callback):
    """This rank's samples in the committed steps."""

    def on_train_begin(self, logs=None):
        self.samples = 0

    def on_train_batch_end(self, batch, logs=None):
        self.samples += engine_of(self.model).last_samples


def test_positions_across_epochs_and_idle_waits(comm, shared_dir):
    if comm.rank == 0:
        land(shared_dir, 0)
        land(shared_dir, 1)
    comm.barrier()
    t0 = time.monotonic()   # (before the model is built: file 2 lands 1 s after this)
    later = threading.Timer(1.0, land, (shared_dir, 2)) if comm.rank == 0 else None
    if later:
        later.start()
    keras.utils.set_random_seed(0)
    x = keras.Input(shape=(), dtype="int64", name="row")
    m = kv.Model({"row": x}, keras.layers.Dense(1)(kv.Embedding("t", 2)(x)))
    m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.BinaryCrossentropy(from_logits=True))
    count = Count()
    # 10 steps in epochs of 3: 8 batches are there at once, the last 2 a second later
    m.fit(stream(shared_dir, idle_timeout=None).dataset(), steps_per_epoch=3, epochs=4,
          verbose=0, callbacks=[count])
    waited = time.monotonic() - t0
    if later:
        later.join()
    assert engine_of(m).step == 12
    pos = progress_of(m)["position"]
    comm.barrier()
    mine = rows_of(stream(shared_dir, idle_timeout=0.3))       # this rank's whole part
    s = stream(shared_dir, idle_timeout=0.3)
    s.resume(pos)
    rest = rows_of(s)
    assert rest.size + count.samples == mine.size, (rest.size, count.samples, mine.size)
    np.testing.assert_array_equal(rest, mine[mine.size - rest.size:])
    # every row of the three files, on some rank, trained or left: once
    done = comm.allreduce(np.array([count.samples, rest.size], np.int64))
    assert int(done.sum()) == 3 * ROWS, done
    if comm.size == 1:   # (on more ranks a step may hold one rank's rows alone)
        assert done[0] == 12 * B, done
    if comm.size <= 2:   # (each rank reads a quarter of a file per step: file 2 was awaited)
        assert waited > 0.8, waited
