"""Uses what one setup.py extra promises, in a bare venv where only kvcoll's wheel with
that extra was installed (`./dev compat extras`). Run outside the checkout, so kvcoll is
the installed one:

    python extras_check.py data      # base, data, kafka, mpi, tf, serve, horovod

Exits non-zero, naming what is missing, when the extra does not deliver.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np


def check_base():
    import kvcoll as kv
    if os.environ.get("KVCOLL_TEST_EXTRAS_BARE"):  # set by ./dev compat extras
        assert "site-packages" in kv.__file__, f"kvcoll is {kv.__file__}, not the wheel"
    t = kv.KvTable(4, name="t")
    rows = t.find_or_create(np.array([1, 2, 1]))
    assert rows.shape == (3, 4) and len(t) == 2
    t.close()


def check_data(tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import kvcoll as kv
    path = os.path.join(tmp, "a.parquet")
    pq.write_table(pa.table({"click": [0, 1, 1, 0], "user": ["a", "b", "a", "c"],
                             "price": [1.0, 2.0, 3.0, 4.0]}), path)
    r = kv.data.read_parquet(path, 2, 0, 1, label="click", numeric=["price"],
                             categorical=["user"])
    assert sum(b["label"].size for b in r) == 4
    line = "\t".join(["1", *["3"] * 13, *["a1b2"] * 26]) + "\n"
    with open(os.path.join(tmp, "d.tsv"), "w") as f:
        f.write(line * 5)
    r = kv.data.read_criteo(os.path.join(tmp, "d.tsv"), 4, 0, 1)
    assert sum(b["label"].size for b in r) == 5


def check_kafka(tmp):
    import confluent_kafka as ck
    check_data(tmp)
    owner = ck.Producer({"test.mock.num.brokers": 1, "log_level": 2})
    assert owner.list_topics(timeout=10).brokers


def check_mpi(tmp):
    bindir = os.path.dirname(sys.executable)
    script = ("import kvcoll as kv; kv.init(); "
              "print('SUM', int(kv.allreduce(kv.rank() + 1, op='sum'))); kv.shutdown()")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([os.path.join(bindir, "mpirun"), "--oversubscribe", "-np", "2",
                          sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.count("SUM 3") == 2, out.stdout + out.stderr


def check_tf(tmp, export=False):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import kvcoll as kv
    from kvcoll.comm import Comm
    from kvcoll.keras import engine_of
    keras = tf.keras
    u = keras.Input(shape=(), dtype="int64", name="user")
    model = kv.Model({"user": u}, keras.layers.Dense(1)(kv.Embedding("user", 4)(u)))
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    x = {"user": np.arange(64, dtype=np.int64) % 7}
    y = (x["user"] % 2).astype(np.float32)
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    if export:
        kv.export(os.path.join(tmp, "ex"), model)
        loaded = tf.saved_model.load(os.path.join(tmp, "ex", "saved_model"))
        out = loaded.signatures["serving_default"](user=tf.constant([1, 2, 99], tf.int64))
        assert out["prediction"].shape[0] == 3


def check_horovod(tmp):
    import tensorflow as tf
    assert tf.__version__.startswith("2.15."), f"TensorFlow {tf.__version__}, not 2.15"
    import mpi4py  # noqa: F401
    bindir = os.path.dirname(sys.executable)
    assert os.access(os.path.join(bindir, "cmake"), os.X_OK), "no cmake in the venv"
    check_tf(tmp)


CHECKS = {"base": lambda tmp: None, "data": check_data, "kafka": check_kafka,
          "mpi": check_mpi, "tf": check_tf, "serve": lambda tmp: check_tf(tmp, export=True),
          "horovod": check_horovod}


def main(extra: str) -> int:
    if extra not in CHECKS:
        print(f"unknown extra {extra!r}; one of {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    check_base()
    with tempfile.TemporaryDirectory() as tmp:
        CHECKS[extra](tmp)
    print(f"extra {extra}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
