"""TFRA's side of `./dev bench peers`: DeepFM on TFRA dynamic embeddings, one process.

    TF_USE_LEGACY_KERAS=1 .venv-peers/tfra/bin/python -m bench.peers.tfra_worker \\
        --data D --out O --steps 300 --threads 2

Runs in its own venv (bench/peers/requirements-tfra.txt: TFRA 0.8.1 on tensorflow 2.16.2
with tf-keras 2.16.0; TF_USE_LEGACY_KERAS=1, as TFRA needs Keras 2).

The model is the same DeepFM as examples/models.py (per field a row of dim + 1 floats:
column 0 the first-order weight, the rest the FM vector; FM second order; an MLP on the
vectors and numerics; glorot-uniform kernels and zero biases, as Keras' defaults), on
one `de.keras.layers.Embedding` (a growable cuckoo hash table on the CPU, one row per
distinct id) looked up with all fields' ids at once: the fields' ids are disjoint, so one
table holds what 26 would, in one lookup, as TFRA's examples do. Embedding rows train
with `de.DynamicEmbeddingOptimizer(Adagrad)`, dense weights with Adam, in one compiled
`tf.function` step (forward, backward, both optimizers). TensorFlow's intra-op pool gets
--threads threads, its inter-op pool 1 (TensorFlow's CPU guidance: intra-op = cores,
inter-op = sockets).

With --horovod, under mpirun (kvcoll's Open MPI, which .venv-peers/tfra's Horovod is built
against), TFRA's synchronous multi-worker path: the table is a
`de.keras.layers.HvdAllToAllEmbedding` (each rank owns the ids its partition function
gives it; lookups and row gradients travel by Horovod alltoall), both optimizers are
`DynamicEmbeddingOptimizer(..., synchronous=True)` (dense gradients summed by Horovod
allreduce, one per variable), the dense weights start from rank 0's
(`hvd.broadcast_variables`), and each rank's loss is its mean divided by the world size,
so that the summed gradients are the global batch's mean.

    mpirun -np 2 .venv-peers/tfra/bin/python -m bench.peers.tfra_worker --horovod ...
"""

from __future__ import annotations

import importlib.metadata
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from . import common


def build(tf, de, args, num_fields: int, num_numeric: int, world: int = 0):
    """DeepFM over one dynamic embedding (with world, a Horovod all-to-all one):
    returns (model, embedding layer)."""
    keras = tf.keras
    width = args.dim + 1
    ids = keras.Input(shape=(num_fields,), dtype=tf.int64, name="ids")
    numeric = keras.Input(shape=(num_numeric,), dtype=tf.float32, name="numeric")
    kind = (lambda *a, **kw: de.keras.layers.HvdAllToAllEmbedding(
        *a, mpi_size=world, **kw)) if world else de.keras.layers.Embedding
    emb = kind(
        embedding_size=width, key_dtype=tf.int64, value_dtype=tf.float32,
        initializer=keras.initializers.RandomNormal(0.0, args.init_std, seed=args.seed),
        devices=["/CPU:0"], name="rows")
    rows = emb(ids)                                                 # [B, F, dim + 1]
    first, vecs = rows[:, :, 0], rows[:, :, 1:]                     # [B, F], [B, F, dim]
    linear = tf.reduce_sum(first, axis=1, keepdims=True)
    linear = linear + keras.layers.Dense(1, name="numeric_linear")(numeric)
    sum_sq = tf.square(tf.reduce_sum(vecs, axis=1))
    sq_sum = tf.reduce_sum(tf.square(vecs), axis=1)
    fm = 0.5 * tf.reduce_sum(sum_sq - sq_sum, axis=1, keepdims=True)
    x = tf.concat([tf.reshape(vecs, [-1, num_fields * args.dim]), numeric], axis=1)
    for i, units in enumerate(args.hidden):
        x = keras.layers.Dense(units, activation="relu", name=f"deep_{i}")(x)
    deep = keras.layers.Dense(1, name="deep_out")(x)
    logit = keras.layers.Add(name="logit")([linear, fm, deep])
    return keras.Model(inputs={"ids": ids, "numeric": numeric}, outputs=logit), emb


def extra_flags(p) -> None:
    p.add_argument("--horovod", action="store_true",
                   help="TFRA's multi-worker path over Horovod (run under mpirun)")


def main(argv=None) -> None:
    args = common.parse(argv, extra_flags)
    import tensorflow as tf
    import tensorflow_recommenders_addons as tfra
    from tensorflow_recommenders_addons import dynamic_embedding as de

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, world, hvd = 0, 1, None
    if args.horovod:
        import horovod.tensorflow as hvd

        hvd.init()
        rank, world = hvd.rank(), hvd.size()
    tf.keras.utils.set_random_seed(args.seed)
    keras = tf.keras

    data = common.Data(args.data)
    model, emb = build(tf, de, args, data.num_fields, data.num_numeric,
                       world if hvd else 0)
    dense_vars = [v for v in model.trainable_variables if "rows" not in v.name]
    if hvd:
        hvd.broadcast_variables(dense_vars, root_rank=0)
    sync = hvd is not None
    # Keras' legacy optimizers: with the current tf.keras Adagrad, TFRA's accumulator slots
    # start at 0 whatever initial_accumulator_value says; the legacy one honours it.
    adam = keras.optimizers.legacy.Adam(args.lr, epsilon=1e-7)
    if sync:
        adam = de.DynamicEmbeddingOptimizer(adam, synchronous=True)
    adagrad = de.DynamicEmbeddingOptimizer(keras.optimizers.legacy.Adagrad(
        args.sparse_lr, initial_accumulator_value=args.sparse_init_accum, epsilon=1e-7),
        synchronous=sync)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    spec = ({"ids": tf.TensorSpec([None, data.num_fields], tf.int64),
             "numeric": tf.TensorSpec([None, data.num_numeric], tf.float32)},
            tf.TensorSpec([None], tf.float32))

    @tf.function(input_signature=spec)
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = loss_fn(labels[:, None], logits)
            scaled = loss / world
        # the rows' trainable wrappers exist only once the model has run: ask for them here
        rows = [v for v in model.trainable_variables if "rows" in v.name]
        grads = tape.gradient(scaled, dense_vars + rows)
        adam.apply_gradients(zip(grads[:len(dense_vars)], dense_vars))
        adagrad.apply_gradients(zip(grads[len(dense_vars):], rows))
        return loss

    @tf.function(input_signature=spec[:1])
    def predict(inputs):
        return model(inputs, training=False)

    def inputs_of(b):
        return {"ids": tf.constant(b["cat"]), "numeric": tf.constant(b["num"])}

    def barrier():
        if hvd:
            hvd.allreduce(tf.constant(0.0), name="barrier").numpy()

    for s in range(args.warmup):
        b = data.batch(s, rank, world)
        step(inputs_of(b), tf.constant(b["label"]))
    barrier()
    t0 = time.perf_counter()
    total = tf.constant(0.0)
    for s in range(args.warmup, args.warmup + args.steps):
        b = data.batch(s, rank, world)
        total += step(inputs_of(b), tf.constant(b["label"]))
    mean_loss = float(total) / max(1, args.steps)      # waits for the last step
    barrier()
    seconds = time.perf_counter() - t0
    peak = common.peak_rss_bytes()
    rows = int(emb.params.size())
    ev = data.eval_part(rank, world)
    chunks = common.eval_chunks(data.eval_size(), world, args.eval_batch)  # same on every rank
    preds = []
    for c in range(chunks):
        lo, hi = common.even_split(len(ev["label"]), c, chunks)
        preds.append(predict({"ids": tf.constant(ev["cat"][lo:hi]),
                              "numeric": tf.constant(ev["num"][lo:hi])}).numpy().ravel())
    config = {
        "model": "DeepFM as examples/models.py, written in tf.keras (Keras 2)",
        "tables": (("one de.keras.layers.HvdAllToAllEmbedding" if hvd else
                    "one de.keras.layers.Embedding")
                   + " (TFRA's CPU cuckoo hash table, growable, default init_capacity) for all "
                   "fields, looked up with [batch, fields] ids at once (ids are disjoint across "
                   "fields); one row per distinct id (no collisions)"
                   + (f"; ids partitioned over {world} ranks, Horovod alltoall" if hvd else "")),
        "training": ("a custom step in one tf.function: forward, backward, both optimizers"
                     + (f"; Horovod over MPI (mpirun), {world} ranks" if hvd else "")),
        "dense_optimizer": (f"tf.keras.optimizers.legacy.Adam({args.lr}, epsilon=1e-7)"
                            + (" in DynamicEmbeddingOptimizer(synchronous=True): Horovod "
                               "allreduce per variable" if hvd else "")),
        "row_optimizer": (f"de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adagrad("
                          f"{args.sparse_lr}, "
                          f"initial_accumulator_value={args.sparse_init_accum}, epsilon=1e-7)"
                          + (", synchronous=True" if hvd else "") + "), per element (the "
                          "legacy optimizer: with the current one TFRA's accumulators start at 0 "
                          "whatever initial_accumulator_value says)"),
        "threads": f"TensorFlow intra-op {args.threads}, inter-op 1",
        "env": {"TF_USE_LEGACY_KERAS": os.environ.get("TF_USE_LEGACY_KERAS")},
        "versions": {"tensorflow": tf.__version__, "tfra": tfra.__version__,
                     "tf_keras": importlib.metadata.version("tf_keras")},
    }
    if hvd:
        config["versions"]["horovod"] = importlib.metadata.version("horovod")
    common.report(args, framework="tfra", rank=rank, world=world, seconds=seconds, rows=rows,
                  preds=np.concatenate(preds), config=config, train_loss=mean_loss,
                  peak_rss=peak)


if __name__ == "__main__":
    main()
