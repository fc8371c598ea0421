"""One side of a cross-lane checkpoint test, run by tests/compat/test_cross_lane.py in
one lane's Python or another's (one process, no mpirun):

    python cross_ckpt.py write DIR [adam|rmsprop]   train, save, record what was saved
    python cross_ckpt.py read DIR [adam|rmsprop]    restore, compare with the record

The checkpoint is kv.save's (its dense part through kvcoll.keras.dense_state, names
both Keras versions read), restored by kv.restore. `read` prints "restored" when the tables are
bit-exact and the dense weights and optimizer state are those saved, or
"CheckpointError: ..." when the checkpoint cannot cross (and exits 3).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402
from kvcoll.keras.dense_state import dense_variables  # noqa: E402

from model import batch, batches, build, keras  # noqa: E402

ROWS = ("keys", "values", "slots", "last_step", "counts")


def model_with(optimizer: str, seed: int):
    model = build(seed=seed)
    engine_of(model, comm=Comm.local())
    dense = {"adam": keras.optimizers.Adam(0.02), "rmsprop": keras.optimizers.RMSprop(0.01)}
    model.compile(optimizer=kv.DistributedOptimizer(dense[optimizer],
                                                    sparse=kv.optimizers.Adagrad(0.2)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def state(model) -> dict:
    out = {f"dense:{k}": np.asarray(v.numpy()) for k, v in
           dense_variables(model, model.optimizer).items()}
    for name, t in engine_of(model).tables.items():
        e = t.export()
        order = np.argsort(e["keys"])
        out.update({f"table:{name}:{k}": e[k][order] for k in ROWS})
    return out


def main(mode: str, directory: str, optimizer: str = "adam") -> int:
    x, _ = batch(99)
    if mode == "write":
        model = model_with(optimizer, seed=3)
        model.fit(batches(0, 5), epochs=1, steps_per_epoch=5, verbose=0)
        kv.save(directory, model)
        np.savez(os.path.join(directory, "expected.npz"), prediction=model.predict(x, verbose=0),
                 **state(model))
        print(f"written by TensorFlow {tf.__version__}, Keras {kv.keras._compat.keras.__version__}")
        return 0
    model = model_with(optimizer, seed=11)      # other initial weights: all must come back
    try:
        kv.restore(directory, model)
    except kv.CheckpointError as exc:
        print(f"CheckpointError: {exc}")
        return 3
    want = np.load(os.path.join(directory, "expected.npz"))
    got = state(model)
    assert sorted(got) == sorted(k for k in want.files if k != "prediction"), \
        (sorted(got), want.files)
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)        # bit for bit
    np.testing.assert_allclose(model.predict(x, verbose=0), want["prediction"],
                               rtol=1e-5, atol=1e-6)
    print(f"restored by TensorFlow {tf.__version__}, Keras {kv.keras._compat.keras.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
