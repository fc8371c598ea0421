"""kvcoll's side of `./dev bench peers`: DeepFM through model.fit, under mpirun.

    mpirun -np 2 .venv/bin/python -m bench.peers.kvcoll_worker --data D --out O --steps 300

The model is examples/models.py's DeepFM with one kv.Embedding (a sharded, growable
table) per field, compiled with kv.DistributedOptimizer(Adam, sparse=Adagrad), trained
by Keras' model.fit on a generator that reads this rank's slice of each global batch
from the shared files; BSP, one fused all-to-all per exchange phase. TensorFlow's
intra-op pool gets --threads threads, its inter-op pool 1.

--row-optimizer rowwise trains the rows with kv.optimizers.RowWiseAdagrad (FBGEMM's
EXACT_ROWWISE_ADAGRAD, what TorchRec's fused tables run: one accumulator per row) with
TorchRec's settings in this bench (the same learning rate, epsilon 1e-7, accumulators
from --sparse-init-accum), instead of per-element Adagrad.
"""

from __future__ import annotations

import os
import sys
import time

from . import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def features(b: dict, num_fields: int) -> dict:
    f = {f"C{i + 1}": b["cat"][:, i] for i in range(num_fields)}
    f["numeric"] = b["num"]
    return f


def extra_flags(p) -> None:
    p.add_argument("--row-optimizer", choices=("adagrad", "rowwise"), default="adagrad",
                   help="Adagrad with one accumulator per float, or row-wise Adagrad (one "
                        "per row, TorchRec's)")


def row_optimizer(args):
    """The rows' optimizer and its description."""
    import kvcoll as kv

    if args.row_optimizer == "rowwise":
        return (kv.optimizers.RowWiseAdagrad(args.sparse_lr, epsilon=1e-7,
                                             initial_accumulator_value=args.sparse_init_accum),
                f"kv.optimizers.RowWiseAdagrad({args.sparse_lr}, initial_accumulator_value="
                f"{args.sparse_init_accum}, epsilon=1e-7): one accumulator per row (FBGEMM's "
                "EXACT_ROWWISE_ADAGRAD, as TorchRec's), in C on the rows' owners")
    return (kv.optimizers.Adagrad(args.sparse_lr, initial_accumulator_value=args.sparse_init_accum),
            f"kv.optimizers.Adagrad({args.sparse_lr}, initial_accumulator_value="
            f"{args.sparse_init_accum}, epsilon=1e-7), per element, in C on the rows' owners")


def main(argv=None) -> None:
    args = common.parse(argv, extra_flags)
    import kvcoll as kv
    from kvcoll import runtime

    kv.init(argv=[])                                       # kvcoll: MPI up
    comm = runtime.comm()
    rank, world = comm.rank, comm.size
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from models import build_deepfm

    from kvcoll.keras import engine_of

    data = common.Data(args.data)
    nf = data.num_fields
    keras.utils.set_random_seed(args.seed)
    model = kv.distribute(build_deepfm(nf, data.num_numeric, args.dim, lambda f, w: kv.Embedding(
        f, w, initializer=("normal", 0.0, args.init_std), seed=args.seed), hidden=args.hidden))
    sparse, sparse_text = row_optimizer(args)
    model.compile(
        optimizer=kv.DistributedOptimizer(                 # kvcoll: dense allreduce, rows in C
            keras.optimizers.Adam(args.lr), sparse=sparse),
        loss=keras.losses.BinaryCrossentropy(from_logits=True))

    def batches(first, n):
        for step in range(first, first + n):
            b = data.batch(step, rank, world)
            yield features(b, nf), b["label"]

    if args.warmup:
        model.fit(batches(0, args.warmup), steps_per_epoch=args.warmup, epochs=1, verbose=0)
    comm.barrier()
    t0 = time.perf_counter()
    hist = model.fit(batches(args.warmup, args.steps), steps_per_epoch=args.steps, epochs=1,
                     verbose=0)
    comm.barrier()
    seconds = time.perf_counter() - t0
    peak = common.peak_rss_bytes()
    tables = engine_of(model).tables.values()
    rows = sum(len(t) for t in tables)
    row_bytes = next(iter(tables)).stats().row_bytes
    ev = data.eval_part(rank, world)
    preds = model.predict(features(ev, nf), batch_size=args.eval_batch, verbose=0)
    config = {
        "model": "examples/models.py build_deepfm, one kv.Embedding per field",
        "training": "model.fit (Keras 3), BSP over MPI (mpirun)",
        "dense_optimizer": f"keras Adam({args.lr}, epsilon=1e-7) in kv.DistributedOptimizer "
                           "(one fused allreduce of the dense gradients)",
        "row_optimizer": sparse_text,
        "row_bytes": f"{row_bytes} bytes a row in the table's arena ({args.dim + 1} floats of "
                     f"embedding, the optimizer's slots, the row's header)",
        "tables": f"{nf} growable hash tables, sharded by id hash over the ranks; "
                  "one row per distinct id (no collisions)",
        "threads": f"TensorFlow intra-op {args.threads}, inter-op 1 per process",
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "kvcoll": getattr(kv, "__version__", "checkout")},
    }
    common.report(args, framework="kvcoll", rank=rank, world=world, seconds=seconds,
                  rows=rows, preds=preds, config=config,
                  train_loss=hist.history["loss"][-1], peak_rss=peak, row_bytes=row_bytes)
    kv.shutdown()


if __name__ == "__main__":
    main()
