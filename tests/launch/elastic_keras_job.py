"""An elastic Keras job for tests/launch/test_elastic.py: a small kv.Model trained with
model.fit on SyntheticCTR's global batches (each rank its part, for the world it is in),
kv.callbacks.Checkpoint saving incrementally, and a kv.callbacks.WorldChange that says
what it saw. --kill-rank R --kill-at S: rank R kills itself (SIGKILL) at step S
(--signal STOP: stops itself, SIGSTOP, as a frozen process).

Rank 0 writes --out: the History, the elastic events and the world changes it saw.
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll import elastic  # noqa: E402
from kvcoll.data import SyntheticCTR  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
FIELDS = 4


def build():
    keras.utils.set_random_seed(1)
    ins = {f"C{i + 1}": keras.Input(shape=(), dtype="int64", name=f"C{i + 1}")
           for i in range(FIELDS)}
    ins["numeric"] = keras.Input(shape=(2,), dtype="float32", name="numeric")
    parts = [kv.Embedding(f"C{i + 1}", 4, initializer=("normal", 0, 0.05), seed=i)(ins[f"C{i + 1}"])
             for i in range(FIELDS)]
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([*parts, ins["numeric"]]))
    return kv.Model(ins, keras.layers.Dense(1, activation="sigmoid")(h))


class Killer(keras.callbacks.Callback):
    def __init__(self, rank, at, sig=signal.SIGKILL):
        super().__init__()
        self.rank, self.at, self.sig = rank, at, sig

    def on_train_batch_end(self, batch, logs=None):
        eng = kv.keras.engine_of(self.model)
        if kv.rank() == self.rank and eng.step == self.at and kv.size() == 3:
            os.kill(os.getpid(), self.sig)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    args, _ = p.parse_known_args()
    kv.init()
    data = SyntheticCTR(num_categorical=FIELDS, num_numeric=2, vocab=5000, seed=2)
    source = data.batches(256, kv.rank(), kv.size(), num_steps=args.steps)
    model = build()
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-2),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")])
    seen = []
    history = model.fit(source.fit_batches(), epochs=1, verbose=0, callbacks=[
        kv.callbacks.Checkpoint(args.ckpt, every_n_steps=20, incremental_every=5),
        kv.callbacks.WorldChange(lambda old, new: seen.append([old, new])),
        Killer(args.kill_rank, args.kill_at, getattr(signal, "SIG" + args.signal))])
    eng = kv.keras.engine_of(model)
    print(f"rank {kv.rank()} of {kv.size()} done at step {eng.step}, world changes {seen}",
          flush=True)
    if kv.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"history": {k: [float(x) for x in v] for k, v in history.history.items()},
                       "events": elastic.events(), "seen": seen, "step": eng.step}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
