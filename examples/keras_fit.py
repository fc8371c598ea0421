"""A plain Keras click-through model, distributed with kvcoll: the lines tagged
`# kvcoll:` are all a single-process script adds (as Horovod's examples tag theirs).

    mpirun -np 2 python examples/keras_fit.py            # or: launch/kvcollrun -np 2 ...
    mpirun -np 2 python examples/keras_fit.py --step-mode ssp --staleness 2

Each rank trains on its own part of the data (here: its slice of a synthetic CTR set
whose labels come from a planted model), with batch_size per rank. The embedding
tables grow with the ids they see, sharded over the ranks; the loss and the AUC in
the logs are over every rank's samples.
"""

import keras
import numpy as np

import kvcoll as kv  # kvcoll:
from kvcoll.data import SyntheticCTR

kv.init()  # kvcoll: MPI up; --step-mode / --staleness read from the command line

FIELDS, NUMERIC, DIM = 8, 4, 8

# The data: 40,000 training samples and 8,000 held out, split over the ranks.
gen = SyntheticCTR(num_categorical=FIELDS, num_numeric=NUMERIC, vocab=100_000, seed=1)


def features(rows):
    x = {f"c{i}": rows["categorical"][:, i] for i in range(FIELDS)}
    x["numeric"] = rows["numeric"]
    return x, rows["label"]


x_train, y_train = features(gen.batch(0, 40_000, kv.rank(), kv.size()))  # kvcoll: my slice
x_val, y_val = features(gen.eval_set(8_000, kv.rank(), kv.size()))  # kvcoll: my slice

# The model: one growable table per categorical field, an MLP on top.
inputs = {f"c{i}": keras.Input(shape=(), dtype="int64", name=f"c{i}") for i in range(FIELDS)}
inputs["numeric"] = keras.Input(shape=(NUMERIC,), name="numeric")
vectors = [kv.Embedding(f"c{i}", DIM)(inputs[f"c{i}"])  # kvcoll: instead of keras.layers.Embedding
           for i in range(FIELDS)]
h = keras.layers.Concatenate()(vectors + [inputs["numeric"]])
h = keras.layers.Dense(64, activation="relu")(h)
model = kv.Model(inputs, keras.layers.Dense(1)(h))

model.compile(
    optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(2e-3),  # kvcoll: dense + rows
                                      sparse=kv.optimizers.Adagrad(0.1)),
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.AUC(from_logits=True, name="auc")])

model.fit(x_train, y_train, batch_size=512, epochs=3, validation_data=(x_val, y_val),
          verbose=2 if kv.rank() == 0 else 0,
          callbacks=[keras.callbacks.EarlyStopping(monitor="val_auc", mode="max", patience=1),
                     kv.callbacks.TableStats()])  # kvcoll: rows, bytes per table in the logs
print(f"rank {kv.rank()}: validation AUC {model.evaluate(x_val, y_val, verbose=0)[1]:.4f}")
kv.shutdown()  # kvcoll:
