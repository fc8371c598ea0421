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
After the timed fit and the evaluation, the same process measures the step's floor
(issue #32's definition) on batches of the timed range, `floor` in the record:
- dense alone: the compiled dense step (forward, backward, the rows' gradient, the
  dense optimizer) on ready-made rows, every rank at once with no communication while
  timed: its wall time a step (the slowest rank) and its CPU time (all ranks);
- sparse alone: everything else a step does: the batch read from the files and
  prepared, the pull and push of its rows (dedup, routing, lookups, the all-to-alls,
  the row optimizer's apply) with a zero gradient, no TensorFlow step: its wall time and
  its CPU time (all ranks; MPI's waits poll, which counts);
- sparse alone on fresh tables: the same, on new empty tables like the model's, over
  every batch of the run, so that it creates the rows the fit created as it went (the
  tables above hold every id already: no row initialized, no arena grown, no index
  rebuilt);
- floor = max(dense wall, (dense CPU + sparse CPU) / cores): what a pipeline that hides
  every wait could reach; step / floor is how far the real step is from it; the same
  with the fresh tables' sparse CPU (`floor_fresh_ms`): the sparse work the fit did.
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
        "steps": (f"pipeline {pipeline_of(engine_of(model))}, XLA "
                  f"{'on' if engine_of(model).xla else 'off'} (--pipeline, --xla; "
                  "KVCOLL_PIPELINE, KVCOLL_XLA)"),
        "huge_pages": (f"{runtime.config().huge_pages}: the tables' memory advised "
                       "MADV_HUGEPAGE or not (--huge-pages, KVCOLL_HUGE_PAGES)"),
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "kvcoll": getattr(kv, "__version__", "checkout")},
    }
    floor = measure_floor(args, model, data, comm, seconds / args.steps)
    common.report(args, framework="kvcoll", rank=rank, world=world, seconds=seconds,
                  rows=rows, preds=preds, config=config,
                  train_loss=hist.history["loss"][-1], peak_rss=peak, row_bytes=row_bytes,
                  floor=floor)
    kv.shutdown()


def pipeline_of(engine) -> str:
    """The engine's --pipeline setting: on, off or semi."""
    return "semi" if engine.stale_rows else "on" if engine.prefetch else "off"


def measure_floor(args, model, data, comm, step_seconds: float, steps: int = 30) -> dict:
    """The dense step alone and the sparse side alone on `steps` batches of the timed
    range, after the run (the tables and weights it leaves are not used again): ms a
    step, wall and CPU (see the module docstring). A collective."""
    import numpy as np

    from kvcoll.keras import engine_of

    eng = engine_of(model)
    ex, compute = eng.loop.ex, eng.compute
    rank, world = comm.rank, comm.size
    nf = data.num_fields
    steps = max(1, min(steps, args.steps))
    first = args.warmup

    def element(step):
        b = data.batch(step, rank, world)
        return features(b, nf), b["label"]

    # sparse alone: read, prepare, pull and push (zero gradient: nothing changes)
    comm.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for step in range(first, first + steps):
        sparse_step(ex, compute, element(step))
    sparse = [time.perf_counter() - t0, time.process_time() - c0]
    comm.barrier()
    # dense alone: ready-made rows, every rank at once, no communication while timed
    ready = []
    for step in range(first, first + steps):
        batch = compute.prepare(element(step))
        ready.append((batch, ex.lookup(compute.ids(batch))))
    flat = np.zeros(compute.n_dense, np.float32)
    compute.train(*ready[0], 1.0 / world)                 # warm (shapes seen in fit)
    comm.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for i, (batch, pulled) in enumerate(ready):
        grads = compute.train(batch, pulled, 1.0 / world)
        compute.apply(flat, grads.state, eng.step + 1 + i)
    dense = [time.perf_counter() - t0, time.process_time() - c0]
    got = comm.allgather(np.array(sparse + dense, np.float64), op="floor") / steps * 1e3
    fresh = sparse_on_fresh_tables(args, eng, data, comm)
    cores = os.cpu_count() or 1
    out = {"steps": steps, "cores": cores, "step_ms": step_seconds * 1e3,
           "sparse_ms": float(got[:, 0].max()), "sparse_cpu_ms": float(got[:, 1].sum()),
           "dense_ms": float(got[:, 2].max()), "dense_cpu_ms": float(got[:, 3].sum()),
           "fresh_steps": args.steps, "sparse_fresh_ms": float(fresh[:, 0].max()),
           "sparse_fresh_cpu_ms": float(fresh[:, 1].sum())}
    for tag, cpu in (("", out["sparse_cpu_ms"]), ("_fresh", out["sparse_fresh_cpu_ms"])):
        out[f"floor{tag}_ms"] = max(out["dense_ms"], (out["dense_cpu_ms"] + cpu) / cores)
        out[f"step_over_floor{tag}"] = out["step_ms"] / out[f"floor{tag}_ms"]
    return out


def sparse_step(ex, compute, element) -> None:
    """A step's sparse side alone: `element` read and prepared, its rows pulled and
    pushed back with a zero gradient (the row optimizer runs; no TensorFlow step)."""
    import numpy as np

    pulled = ex.pull(compute.ids(compute.prepare(element)))
    ex.push(pulled, {g: np.zeros_like(m) for g, m in pulled.rows.items()}).commit()


def sparse_on_fresh_tables(args, eng, data, comm):
    """The sparse side alone as the fit ran it: on new, empty tables like the model's,
    every batch from the first (the warmup's untimed), so that it creates the rows the
    fit created (row initialization, arena growth, index rebuilds: CPU that the tables
    measure_floor times first, which hold every id already, never spend). Per rank,
    [wall, CPU] ms a timed step (a collective)."""
    import numpy as np

    import kvcoll as kv
    from kvcoll.exchange.bsp import BspExchange

    rank, world, nf = comm.rank, comm.size, data.num_fields
    tables = {n: kv.KvTable(t.dim, name=n, seed=t.seed, initializer=t.initializer,
                            optimizer=t.optimizer) for n, t in eng.tables.items()}
    try:
        ex, compute = BspExchange(comm, tables, owners=eng.loop.ex.owners), eng.compute

        def one(step):
            b = data.batch(step, rank, world)
            sparse_step(ex, compute, (features(b, nf), b["label"]))

        for step in range(args.warmup):
            one(step)
        comm.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            one(step)
        took = [time.perf_counter() - t0, time.process_time() - c0]
    finally:
        for t in tables.values():
            t.close()
    return comm.allgather(np.array(took, np.float64), op="floor") / args.steps * 1e3


if __name__ == "__main__":
    main()
