"""Horovod's Keras example, a click-through model with kvcoll embedding tables: the
shape of Horovod's tensorflow2_keras_mnist.py, with every line kvcoll adds tagged
`# kvcoll:` (Horovod's own lines keep their `# Horovod:` comments).

    horovodrun -np 2 python examples/horovod_keras.py        # TensorFlow 2.15 + Horovod 0.28
    mpirun -np 2 python examples/horovod_keras.py            # the same job under mpirun

Horovod does what it does in any Keras script (hvd.init, the DistributedOptimizer
wrapper, the broadcast and warm-up callbacks); kvcoll adds growable, sharded embedding
tables. The dense gradients ride Horovod's allreduce (kv.DistributedOptimizer wrapping
hvd.DistributedOptimizer); the embedding rows go through kvcoll's all-to-all to the
ranks that own them. `--dense-backend kvcoll` sends the dense gradients through
kvcoll's own allreduce instead: the same losses. `--losses-out FILE` writes every
step's loss (rank 0).
"""

import argparse
import itertools
import json

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

import kvcoll as kv  # kvcoll:
from kvcoll.data import SyntheticCTR  # kvcoll: a synthetic CTR set with a planted model

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps", type=int, default=40, help="steps per epoch")
p.add_argument("--batch-size", type=int, default=256, help="per rank")
p.add_argument("--dense-backend", choices=("horovod", "kvcoll"), default="horovod")  # kvcoll:
p.add_argument("--losses-out", default=None)
args, _ = p.parse_known_args()

# Horovod: initialize Horovod.
hvd.init()
kv.init()  # kvcoll: the same MPI world, kvcoll's own communicator (either order works)

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
keras = tf.keras

# Click logs: 8 categorical fields (ids over 10^5 each) and 4 numeric ones.
ctr = SyntheticCTR(num_categorical=8, num_numeric=4, vocab=100_000, seed=1)
FIELDS = [f"c{i}" for i in range(ctr.num_categorical)]


def inputs_and_labels(part):
    return dict(zip(FIELDS, part["categorical"].T), numeric=part["numeric"]), part["label"]


# Horovod: each worker reads its own slice of every global batch.
def dataset():
    for step in itertools.count():
        yield inputs_and_labels(ctr.batch(step, args.batch_size * hvd.size(), hvd.rank(),
                                          hvd.size()))


keras.utils.set_random_seed(4)
ids = [keras.Input(shape=(), dtype="int64", name=f) for f in FIELDS]
numeric = keras.Input(shape=(ctr.num_numeric,), name="numeric")
vectors = [kv.Embedding(t.name, 8)(t) for t in ids]  # kvcoll: a growable table per field
hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()([*vectors, numeric]))
model = kv.Model({t.name: t for t in [*ids, numeric]}, keras.layers.Dense(1)(hidden))

# Horovod: adjust learning rate based on number of workers.
scaled_lr = 0.002 * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt)
opt = kv.DistributedOptimizer(opt, sparse=kv.optimizers.Adagrad(0.1),  # kvcoll: rows in C
                              dense_backend=args.dense_backend)  # kvcoll: who sums dense grads

model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True), optimizer=opt,
              metrics=[keras.metrics.AUC(from_logits=True, name="auc")])


class StepLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


steps = StepLosses()
callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # (kvcoll's tables are not variables: kvcoll keeps them, sharded.)
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch. Not needed with
    # kvcoll (the logs are already exact over every rank's samples: AUC of all the data).
    # hvd.callbacks.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first epoch.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
    steps,
]

# Horovod: write logs on worker 0.
verbose = 2 if hvd.rank() == 0 else 0

history = model.fit(dataset(), steps_per_epoch=args.steps, callbacks=callbacks,
                    epochs=args.epochs, verbose=verbose)

x_val, y_val = inputs_and_labels(ctr.eval_set(20_000, hvd.rank(), hvd.size()))
logs = model.evaluate(x_val, y_val, batch_size=4096, verbose=0, return_dict=True)
if hvd.rank() == 0:
    print(f"validation AUC {logs['auc']:.4f} (planted {ctr.planted_auc(20_000):.4f})")
    if args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"step_losses": steps.losses, "history": history.history,
                       "val": logs, "dense_backend": args.dense_backend,
                       "world": hvd.size()}, f, default=float)
kv.shutdown()  # kvcoll:
