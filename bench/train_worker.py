"""One training measurement, run under mpirun by bench/train_bench.py.

    mpirun -np 2 python bench/train_worker.py --impl kvcoll --steps 200 --out r.json

--impl kvcoll    DeepFM on kvcoll tables (kv.Trainer: a hand-written step loop, BSP)
--impl fit       the same through model.fit (a generator of the same batches,
                 steps_per_epoch, verbose=0): what Keras' loop and callbacks add
--impl baseline  the same DeepFM on fixed-size keras Embeddings over ids hashed modulo
                 --baseline-vocab rows per field, sparse Adagrad on the rows a batch
                 touches, gradients exchanged as Horovod does: one fused allreduce of the
                 dense gradients, allgather of the embeddings' sparse gradients
--impl baseline-gather   the same, but each embedding reads its rows with a
                 ResourceGather on the underlying tf.Variable (tf.nn.embedding_lookup)
                 instead of keras.layers.Embedding's call, which on TensorFlow 2.21 / Keras
                 3 converts the whole table to a tensor every step
--impl exchange  kvcoll's sparse side alone: the same batches' pulls and pushes through
                 the Trainer's exchange and tables (every rank, over MPI), with a fixed
                 gradient and no TensorFlow step in between: what a step costs beyond
                 the dense step when nothing else (glue, data, caches) is counted
--impl limit     kvcoll's compiled dense step alone, fed ready-made rows of each
                 batch's unique ids, and the gradient of those rows it returns (summed
                 per row, in C, as the Trainer does): no table, no exchange. Under
                 mpirun -np N, N independent processes run it at the same time (no
                 communication while timed): the per-process limit when N ranks share
                 the machine

--impl horovod-blocks   inside one Horovod job (hvd.init() first), blocks of --block
                 steps alternating four settings, in a rotating order, --rounds times:
                 the dense gradients through kvcoll's allreduce or Horovod's, with Open
                 MPI spinning in its waits or yielding when idle (switched between
                 blocks, on every rank alike): each comparison made under the same
                 conditions (python -m bench train --horovod)
--impl dense     the compiled dense step taken apart (bench/results/dense.md), one
                 process: the model's forward and backward alone; plus kvcoll's
                 gradient outputs (the flat dense gradient, each rows matrix's gradient
                 as gathered rows); plus the metrics (kvcoll's train function); then
                 what surrounds it (inputs in, gradients out, gather_grad in C, finite
                 checks) and the dense optimizer's apply. --xla: all of it under XLA

--xla on|off     compile the dense step with XLA (kv.Trainer(xla=...))
--prefetch on|off   pipelined steps: --impl kvcoll steps with kv.Trainer.train_next
                 over an iterator of the batches (read and prepared in the helper
                 thread), --impl fit through model.fit; off: the unpipelined loop

--dense-backend horovod   (with --impl kvcoll or fit) the dense gradients ride Horovod's
                 allreduce (hvd.init() first; kv.DistributedOptimizer(dense_backend=
                 "horovod")) instead of kvcoll's own fused MPI allreduce: the Horovod
                 lane's comparison (python -m bench train --horovod, TensorFlow 2.15)

Every implementation sees the same data (kvcoll.data.SyntheticCTR: the global batch of
step t is the same at any world size; with --data, the same samples written as a
Criteo TSV file and read back by kvcoll.data.read_criteo), the same model code
(examples/models.py), the same optimizers and hyperparameters (examples/train.py's defaults) and the same thread
budget per rank (--threads for TensorFlow's intra-op pool, inter-op 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_FIELDS, NUM_NUMERIC = 26, 13


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("kvcoll", "fit", "baseline", "baseline-gather", "limit",
                                      "exchange", "horovod-blocks", "dense", "ab"),
                   required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--limit-batch", type=int, default=0,
                   help="limit: the per-rank batch to measure (default --batch-size)")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden", default="",
                   help="deep MLP units, comma-separated (default: examples/models.py's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline-vocab", type=int, default=10**6)
    p.add_argument("--eval-samples", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=10**7, help="synthetic ids per field")
    p.add_argument("--dense-backend", choices=("kvcoll", "horovod"), default="kvcoll")
    p.add_argument("--data", metavar="PATH",
                   help="kvcoll: train on this Criteo TSV file (kvcoll.data.read_criteo, "
                        "split='global', read ahead in a thread) instead of generating batches")
    p.add_argument("--eval-data", metavar="PATH", help="with --data: the Criteo TSV to evaluate on")
    p.add_argument("--block", type=int, default=25, help="horovod-blocks: steps per block")
    p.add_argument("--rounds", type=int, default=6, help="horovod-blocks: rounds of 4 blocks")
    p.add_argument("--xla", choices=("on", "off"), default="off")
    p.add_argument("--prefetch", choices=("on", "off"), default="off")
    p.add_argument("--ab", choices=("pipeline", "xla", "pipeline-fit"), default=None,
                   help="--impl ab: two trainers in this process, A (pipeline / XLA off) "
                        "and B (on), stepping the same batches in alternating blocks")
    p.add_argument("--ab-block", type=int, default=10, help="--impl ab: steps a block")
    p.add_argument("--dense-variants", default="plain,xla",
                   help="--impl dense: which variants to time (plain, xla)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.impl == "horovod-blocks":
        args.dense_backend = "horovod"
    return args


def keras2_ops():
    """Keras 3's keras.ops functions examples/models.py uses, as TensorFlow ops (Keras 2,
    the Horovod lane's, has no keras.ops; its functional models take TensorFlow ops)."""
    import types

    import tensorflow as tf

    def split(x, indices, axis=0):
        cuts = [0, *indices, x.shape[axis]]
        return tf.split(x, [b - a for a, b in zip(cuts, cuts[1:])], axis=axis)

    return types.SimpleNamespace(
        split=split, sum=lambda x, axis=None, keepdims=False: tf.reduce_sum(x, axis, keepdims),
        concatenate=lambda xs, axis=0: tf.concat(xs, axis), stack=lambda xs, axis=0:
        tf.stack(xs, axis), square=tf.square, reshape=tf.reshape)


def features(batch):
    f = {f"C{i + 1}": batch["categorical"][:, i] for i in range(NUM_FIELDS)}
    f["numeric"] = batch["numeric"]
    return f


def main(argv=None):
    args = parse(argv)
    import kvcoll as kv
    from kvcoll import runtime
    from kvcoll.comm import Comm
    from kvcoll.data import SyntheticCTR, auc

    if args.dense_backend == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
    kv.init(argv=[])
    comm = Comm.local() if args.impl in ("limit", "dense") else runtime.comm()
    world_comm = runtime.comm()
    rank, world = comm.rank, comm.size

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    if not hasattr(keras, "ops"):
        keras.ops = keras2_ops()
    from models import DEFAULT_HIDDEN, build_deepfm
    args.hidden = tuple(int(u) for u in args.hidden.split(",") if u.strip()) or DEFAULT_HIDDEN
    from train import DEFAULTS

    keras.utils.set_random_seed(args.seed)
    data = SyntheticCTR(seed=args.seed, vocab=args.vocab)
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    adam = keras.optimizers.Adam(DEFAULTS["lr"])

    if args.impl.startswith("baseline"):
        step_fn, predict = baseline(args, comm, tf, keras, build_deepfm, loss, adam,
                                    gather=args.impl == "baseline-gather")
        timings = None
    else:
        model = kv.distribute(build_deepfm(NUM_FIELDS, NUM_NUMERIC, args.dim, lambda f, w: kv.Embedding(
            f, w, initializer=("normal", 0.0, DEFAULTS["init_std"]), seed=args.seed),
            hidden=args.hidden))
        opt = kv.DistributedOptimizer(adam, sparse=kv.optimizers.Adagrad(
            DEFAULTS["sparse_lr"], initial_accumulator_value=DEFAULTS["sparse_init_accum"]),
            dense_backend=args.dense_backend)
        trainer = kv.Trainer(model, loss, opt, comm=comm, xla=args.xla == "on",
                             prefetch=args.prefetch == "on")
        kv.broadcast_variables(model.variables, root_rank=0, comm=comm)
        if args.impl == "limit":
            return limit(args, trainer, data, tf, world_comm)
        if args.impl == "ab":
            def make_ab(on):
                keras.utils.set_random_seed(args.seed)      # A and B start alike
                m = kv.distribute(build_deepfm(
                    NUM_FIELDS, NUM_NUMERIC, args.dim, lambda f, w: kv.Embedding(
                        f, w, initializer=("normal", 0.0, DEFAULTS["init_std"]),
                        seed=args.seed), hidden=args.hidden))
                o = kv.DistributedOptimizer(
                    keras.optimizers.Adam(DEFAULTS["lr"]),
                    sparse=kv.optimizers.Adagrad(
                        DEFAULTS["sparse_lr"],
                        initial_accumulator_value=DEFAULTS["sparse_init_accum"]))
                xla = on if args.ab == "xla" else False
                prefetch = on if args.ab != "xla" else False
                t = kv.Trainer(m, loss, o, comm=comm, xla=xla, prefetch=prefetch)
                kv.broadcast_variables(m.variables, root_rank=0, comm=comm)
                return t

            return ab(args, data, comm, make_ab)
        if args.impl == "dense":
            def make(xla):
                m = kv.distribute(build_deepfm(
                    NUM_FIELDS, NUM_NUMERIC, args.dim, lambda f, w: kv.Embedding(
                        f, w, initializer=("normal", 0.0, DEFAULTS["init_std"]),
                        seed=args.seed), hidden=args.hidden))
                o = kv.DistributedOptimizer(keras.optimizers.Adam(DEFAULTS["lr"]),
                                            sparse=kv.optimizers.Adagrad(DEFAULTS["sparse_lr"]))
                return kv.Trainer(m, loss, o, comm=comm, xla=xla, prefetch=False)

            return dense_probe(args, data, tf, loss, make)
        if args.impl == "exchange":
            return exchange_only(args, trainer, data, comm)
        if args.impl == "fit":
            return fit(args, trainer, data, comm)
        if args.impl == "horovod-blocks":
            return horovod_blocks(args, trainer, data, comm, opt)
        step_fn = trainer.train_step
        predict = trainer.predict
        timings = trainer.timings

    if args.data:  # this rank's slice of each global batch of the file, read ahead
        from kvcoll.data import read_criteo

        batches = iter(read_criteo(args.data, args.batch_size, rank, world))

        def get(step):
            return next(batches)
    else:
        def get(step):
            return data.batch(step, args.batch_size, rank, world)

    pipelined = args.prefetch == "on" and timings is not None
    if pipelined:      # the pipelined loop: the helper thread reads the batches
        def stream():
            for step in range(args.warmup + args.steps):
                b = get(step)
                yield features(b), b["label"]

        batches = stream()

    def one(step):
        """One step: (seconds spent making the batch here, the loss)."""
        if pipelined:
            return 0.0, trainer.train_next(batches)
        td = time.perf_counter()
        b = get(step)
        f = features(b)
        made = time.perf_counter() - td
        return made, step_fn(f, b["label"])

    for step in range(args.warmup):
        one(step)
    comm.barrier()
    t0_timings = dict(timings) if timings is not None else None
    row_bytes0 = table_row_bytes(trainer) if timings is not None else 0
    t0 = time.perf_counter()
    last, data_s = 0.0, 0.0
    for step in range(args.warmup, args.warmup + args.steps):
        made, last = one(step)
        data_s += made
    comm.barrier()
    elapsed = time.perf_counter() - t0
    if timings is not None:
        new_mb = (table_row_bytes(trainer) - row_bytes0) / args.steps / 1e6
        touch = first_touch_gbps()
        new_mb, touch = comm.allgather(np.array([new_mb, touch]), op="new-memory").mean(axis=0)

    if args.eval_data:
        from kvcoll.data import read_criteo

        ev = next(iter(read_criteo(args.eval_data, args.eval_samples, rank, world)))
    else:
        ev = data.eval_set(args.eval_samples, rank, world)
    preds = np.asarray(predict(features(ev)), np.float32).reshape(-1)
    all_preds, _ = comm.allgatherv(preds)
    all_labels, _ = comm.allgatherv(ev["label"].astype(np.float32))
    record = {
        "impl": args.impl, "world_size": world, "global_batch_size": args.batch_size,
        "hidden": list(args.hidden),
        "steps": args.steps, "samples_per_sec": args.steps * args.batch_size / elapsed,
        "eval_auc": auc(all_labels, all_preds),
        "planted_auc": data.planted_auc(args.eval_samples),
        "final_loss": float(last), "threads_per_rank": args.threads,
        "c_threads": c_threads(),
        "samples_trained": (args.warmup + args.steps) * args.batch_size,
        "dense_backend": args.dense_backend,
        "data": "criteo-tsv" if args.data else "synthetic",
        "xla": args.xla, "prefetch": args.prefetch, "dim": args.dim,
    }
    if timings is not None:
        per_step = {k: (timings[k] - t0_timings[k]) / args.steps * 1e3 for k in timings}
        per_step["data"] = data_s / args.steps * 1e3
        per_step["total"] = elapsed / args.steps * 1e3
        record["ms_per_step"] = per_step
        record["new_rows_mb_per_step"] = float(new_mb)  # per rank
        record["first_touch_gbps"] = float(touch)
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def c_threads() -> int:
    """The C threads of the exchange kernels (KVCOLL_THREADS; 0 = the cores TensorFlow
    leaves free)."""
    from kvcoll.exchange import kernels

    return kernels.threads()


def table_row_bytes(trainer) -> int:
    """Bytes of the rows this rank's shards hold (rows x header, floats and slots)."""
    return sum(len(t) * t.stats().row_bytes for t in trainer.tables.values())


def first_touch_gbps(size: int = 256 << 20) -> float:
    """How fast this machine gives a process new memory, in GB/s: the first write to
    every page of a fresh mapping advised for huge pages, as kvcoll's arena chunks are.
    Measured after the timed steps (the pages it frees would otherwise serve the run's
    first new rows at the speed of reused memory)."""
    import mmap

    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    pages = np.frombuffer(m, np.uint8)
    t0 = time.perf_counter()
    pages[::4096] = 1
    seconds = time.perf_counter() - t0
    del pages
    m.close()
    return size / seconds / 1e9


BLOCK_SETTINGS = (("kvcoll", "spin"), ("horovod", "spin"), ("kvcoll", "yield"),
                  ("horovod", "yield"))


def horovod_blocks(args, trainer, data, comm, opt):
    """See --impl horovod-blocks: samples/s of every block, by (dense backend, Open MPI's
    waits). The backend is the optimizer's setting, read by the engine every step; the
    waits are Open MPI's yield-when-idle flag (kvcoll.keras._horovod)."""
    import kvcoll as kv
    from kvcoll.keras import _horovod

    switch = _horovod._opal_function("opal_progress_set_yield_when_idle")
    if switch is None:
        raise SystemExit("horovod-blocks needs Open MPI (its yield-when-idle switch)")
    import ctypes

    switch.argtypes, switch.restype = [ctypes.c_bool], None
    step = 0

    def run(n, backend, waits):
        nonlocal step
        opt._kvcoll_dense_backend = backend
        switch(waits == "yield")
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            b = data.batch(step, args.batch_size, comm.rank, comm.size)
            trainer.train_step(features(b), b["label"])
            step += 1
        comm.barrier()
        return n * args.batch_size / (time.perf_counter() - t0)

    for backend, waits in BLOCK_SETTINGS:
        run(max(1, args.warmup // len(BLOCK_SETTINGS)), backend, waits)   # compiled, warm
    blocks = {f"{b}/{w}": [] for b, w in BLOCK_SETTINGS}
    for r in range(args.rounds):
        order = BLOCK_SETTINGS[r % 4:] + BLOCK_SETTINGS[:r % 4]
        for backend, waits in order:
            blocks[f"{backend}/{waits}"].append(run(args.block, backend, waits))
    record = {"impl": args.impl, "world_size": comm.size, "global_batch_size": args.batch_size,
              "block_steps": args.block, "rounds": args.rounds, "blocks": blocks,
              "median_samples_per_sec": {k: float(np.median(v)) for k, v in blocks.items()},
              "threads_per_rank": args.threads}
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def fit(args, trainer, data, comm):
    """model.fit on the same batches as --impl kvcoll: a generator makes each batch (as
    the loop does, inside the timed span), Keras' fit loop with its callbacks (History;
    no progress bar) drives kvcoll's steps."""
    import kvcoll as kv
    from kvcoll.data import auc

    rank, world = comm.rank, comm.size
    model = trainer.model

    def batches(first, n):
        for step in range(first, first + n):
            b = data.batch(step, args.batch_size, rank, world)
            yield features(b), b["label"]

    model.fit(batches(0, args.warmup), steps_per_epoch=args.warmup, epochs=1, verbose=0)
    eng = trainer.engine
    timings0 = dict(eng.timings)
    comm.barrier()
    t0 = time.perf_counter()
    hist = model.fit(batches(args.warmup, args.steps), steps_per_epoch=args.steps, epochs=1,
                     verbose=0)
    comm.barrier()
    elapsed = time.perf_counter() - t0
    ev = data.eval_set(args.eval_samples, rank, world)
    preds = model.predict(features(ev), batch_size=16384, verbose=0).reshape(-1)
    all_preds, _ = comm.allgatherv(preds.astype(np.float32))
    all_labels, _ = comm.allgatherv(ev["label"].astype(np.float32))
    per_step = {k: (eng.timings[k] - timings0[k]) / args.steps * 1e3 for k in eng.timings}
    per_step["total"] = elapsed / args.steps * 1e3
    record = {
        "impl": "fit", "world_size": world, "global_batch_size": args.batch_size,
        "hidden": list(args.hidden), "steps": args.steps,
        "samples_per_sec": args.steps * args.batch_size / elapsed,
        "eval_auc": auc(all_labels, all_preds),
        "planted_auc": data.planted_auc(args.eval_samples),
        "final_loss": float(hist.history["loss"][-1]), "threads_per_rank": args.threads,
        "samples_trained": (args.warmup + args.steps) * args.batch_size,
        "ms_per_step": per_step, "xla": args.xla, "prefetch": args.prefetch, "dim": args.dim,
    }
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def limit(args, trainer, data, tf, world_comm):
    """Time the compiled dense step (forward, backward, the rows' gradient, dense
    optimizer) alone; with N processes, all N at once (each its own, no communication
    while timed)."""
    import kvcoll as kv

    n = args.limit_batch or args.batch_size
    eng = trainer.engine
    batches = []
    for step in range(8):
        b = data.batch(step, n)
        trainer.train_step(features(b), b["label"])  # compiles, grows the tables
        compute = eng.compute
        batch = compute.prepare((features(b), b["label"]))
        batches.append((batch, eng.loop.ex.lookup(compute.ids(batch))))
    flat = np.zeros(compute.n_dense, np.float32)

    def one(i):
        batch, pulled = batches[i % len(batches)]
        grads = compute.train(batch, pulled, 1.0)      # forward, backward, rows' gradient
        compute.apply(flat, grads.state, 1)            # the dense optimizer

    for i in range(5):
        one(i)
    reps = max(20, args.steps // 4)
    world_comm.barrier()
    t0 = time.perf_counter()
    for i in range(reps):
        one(i)
    elapsed = time.perf_counter() - t0
    rates = world_comm.allgather(np.array([reps * n / elapsed]), op="limit:rates")[:, 0]
    ms = world_comm.allgather(np.array([elapsed / reps * 1e3]), op="limit:ms")[:, 0]
    record = {"impl": "limit", "world_size": world_comm.size, "global_batch_size": n * world_comm.size,
              "hidden": list(args.hidden),
              "samples_per_sec": float(rates.sum()), "eval_auc": None,
              "threads_per_rank": args.threads, "ms_per_step": {"total": float(ms.mean())}}
    if world_comm.rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def ab(args, data, comm, make):
    """A (off) and B (on) in one process: two trainers of the same model, each over its
    own iterator of the same batches, stepping alternating blocks of --ab-block steps
    (A B A B ...), so both see the machine's load alike; B / A per pair of blocks."""
    import statistics

    import kvcoll as kv
    from kvcoll.data import auc

    rank, world = comm.rank, comm.size
    sides = {"A": make(False), "B": make(True)}

    def stream():
        for step in range(args.warmup + args.steps):
            b = data.batch(step, args.batch_size, rank, world)
            yield features(b), b["label"]

    its = {k: stream() for k in sides}
    fit = args.ab == "pipeline-fit"

    def block(k, n):
        t = sides[k]
        if fit:
            hist = t.model.fit(its[k], steps_per_epoch=n, epochs=1, verbose=0)
            return hist.history["loss"][-1]
        for _ in range(n):
            last = t.train_next(its[k])
        return last

    for k in sides:
        block(k, args.warmup)
    seconds = {k: [] for k in sides}
    last = {}
    for _ in range(args.steps // args.ab_block):
        for k in sides:
            comm.barrier()
            t0 = time.perf_counter()
            last[k] = block(k, args.ab_block)
            comm.barrier()
            seconds[k].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(seconds["A"], seconds["B"])]   # B's speed over A's
    ev = data.eval_set(args.eval_samples, rank, world)
    aucs = {}
    for k, t in sides.items():
        preds = np.asarray(t.predict(features(ev)), np.float32).reshape(-1)
        all_preds, _ = comm.allgatherv(preds)
        all_labels, _ = comm.allgatherv(ev["label"].astype(np.float32))
        aucs[k] = auc(all_labels, all_preds)
    record = {"impl": "ab", "ab": args.ab, "world_size": world, "threads_per_rank": args.threads,
              "global_batch_size": args.batch_size, "dim": args.dim, "block": args.ab_block,
              "steps": args.steps, "ratio": statistics.median(ratios), "ratios": ratios,
              "samples_per_sec": {k: args.ab_block * args.batch_size / statistics.median(v)
                                  for k, v in seconds.items()},
              "final_loss": {k: float(v) for k, v in last.items()}, "eval_auc": aucs}
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def dense_probe(args, data, tf, loss_obj, make_trainer):
    """The compiled dense step taken apart, one process, on ready-made rows of real
    batches, plain and under XLA in the same process (two trainers of the same model,
    timed in interleaved rounds; ms a step, medians over the rounds):

    model      forward and backward of the model alone (a tf.function of the loss and
               the gradients of the dense weights and the rows matrices)
    grads      + kvcoll's gradient outputs: the flat dense gradient, each rows matrix's
               gradient as (gathered rows, positions)
    train_fn   kvcoll's own compiled train function: + the metrics (the loss tracker and
               the compiled metrics, their state in and out)
    train      compute.train(): + the inputs made tensors, the outputs made numpy, the
               rows' gradient summed in C (gather_grad), the finite checks
    apply      compute.apply(): the dense optimizer on the summed gradient, the logs
    gather     gather_grad alone (inside train)
    """
    import statistics

    import kvcoll as kv
    from kvcoll.exchange.bsp import group_key
    from kvcoll.exchange.kernels import gather_grad
    from kvcoll.keras.compute import _gathered_grad, as_input
    from kvcoll.keras.embedding import rows_scope

    n = args.limit_batch or args.batch_size
    runs = {}
    for variant in args.dense_variants.split(","):
        runs[variant] = _dense_variant(args, data, tf, loss_obj, make_trainer(variant == "xla"),
                                       n, group_key, gather_grad, _gathered_grad, as_input,
                                       rows_scope)
    names = ["model", "grads", "train_fn", "gather", "train", "apply"]
    for i in range(8):                       # compile every shape first
        for variant, run in runs.items():
            for name in names:
                run(name, i)
    reps = max(10, args.steps // 10)
    times = {v: {name: [] for name in names} for v in runs}
    for r in range(7):                       # interleaved rounds
        for variant, run in runs.items():
            for name in names:
                t0 = time.perf_counter()
                for i in range(reps):
                    run(name, i)
                times[variant][name].append((time.perf_counter() - t0) / reps * 1e3)
    ms = {v: {name: statistics.median(t) for name, t in d.items()} for v, d in times.items()}
    ratio = {name: statistics.median(x / p for x, p in zip(times["xla"][name],
                                                             times["plain"][name]))
             for name in names} if len(runs) == 2 else None
    record = {"impl": "dense", "batch": n, "dim": args.dim, "threads": args.threads,
              "hidden": list(args.hidden), "ms": ms, "xla_over_plain": ratio,
              "rounds": times, "reps": reps,
              "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")}
    Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def _dense_variant(args, data, tf, loss_obj, trainer, n, group_key, gather_grad,
                   _gathered_grad, as_input, rows_scope):
    """The timed pieces of one trainer's dense step: run(name, i) runs piece `name` on
    ready-made batch i."""
    eng = trainer.engine
    batches = []
    for step in range(8):
        b = data.batch(step, n)
        trainer.train_step(features(b), b["label"])    # compiles, grows the tables
        compute = eng.compute
        batch = compute.prepare((features(b), b["label"]))
        batches.append((batch, eng.loop.ex.lookup(compute.ids(batch))))
    model, lay = compute.model, compute.layout
    dense_vars = compute.dense_vars

    def model_call(ids, dense, rows):
        leaves = dict(dense)
        for f, t in zip(lay.single, tf.unstack(tf.reshape(ids, [len(lay.single), -1]))):
            leaves[f] = as_input(t, compute.input_dtypes[f])
        x = lay.rebuild(leaves)
        with rows_scope({t: rows[group_key(tab.dim)] for t, tab in compute.tables.items()}):
            return model(x, training=True)

    def grads_of(ids, dense, rows, y):
        with tf.GradientTape() as tape:
            tape.watch(list(rows.values()))
            out = model_call(ids, dense, rows)
            loss = tf.reduce_mean(loss_obj(y[:, None], out))
        return loss, tape.gradient(loss, [*dense_vars, *rows.values()])

    def model_only(ids, dense, rows, y):
        loss, grads = grads_of(ids, dense, rows, y)
        return loss, [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]

    def with_grads(ids, dense, rows, y):
        loss, grads = grads_of(ids, dense, rows, y)
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1])
                          for g in grads[:len(dense_vars)]], 0)
        return loss, flat, {k: _gathered_grad(g, rows[k])
                            for k, g in zip(rows, grads[len(dense_vars):])}

    xla = compute.xla
    fns = {name: tf.function(fn, jit_compile=xla or None, autograph=False,
                             reduce_retracing=True)
           for name, fn in (("model", model_only), ("grads", with_grads))}
    prepared = []
    for batch, pulled in batches:
        (ids, _, dense), rows = compute._inputs(batch, pulled)
        prepared.append((ids, dense, rows, tf.constant(batch.y[0]), batch, pulled))
    train_fn = compute._fn("train")
    weight, state0 = tf.constant(1.0), tf.constant(compute.state())
    flat = np.zeros(compute.n_dense, np.float32)
    row_np = {}

    def run(name, i):
        ids, dense, rows, y, batch, pulled = prepared[i % len(prepared)]
        if name in fns:
            out = fns[name](ids, dense, rows, y)
            out[0].numpy()
        elif name == "train_fn":
            inputs, rows2 = compute._inputs(batch, pulled)
            out = train_fn(inputs, rows2, *compute._targets(batch), weight, state0)
            out[0].numpy()
            row_np.clear()
            row_np.update({g: (v.numpy(), j.numpy(), pulled.rows[g].shape[0])
                           for g, (v, j) in out[2].items()})
        elif name == "train":
            compute.train(batch, pulled, 1.0)
        elif name == "apply":
            compute.apply(flat, compute.state(), 1)
        elif name == "gather":
            for v, j, k in row_np.values():
                gather_grad(v, j, k)

    return run


def exchange_only(args, trainer, data, comm):
    """Time the pulls and pushes of the same batches as --impl kvcoll (the trainer's
    exchange and tables, a fixed gradient, no TensorFlow step): the sparse side's cost
    per step with nothing else in between. Data generation is not timed."""
    import kvcoll as kv

    rank, world = comm.rank, comm.size
    eng = trainer.engine
    b = data.batch(0, args.batch_size, rank, world)
    eng.begin((features(b), b["label"]))               # the engine set up, no step
    ex = eng.loop.ex

    def one(step):
        b = data.batch(step, args.batch_size, rank, world)
        ids = eng.compute.ids(eng.compute.prepare((features(b), b["label"])))
        t0 = time.perf_counter()
        pulled = ex.pull(ids)
        ex.push(pulled, {g: np.full_like(m, 1e-4) for g, m in pulled.rows.items()}).commit()
        return time.perf_counter() - t0

    for step in range(args.warmup):
        one(step)
    comm.barrier()
    t0_tables = ex.table_seconds
    spent = sum(one(step) for step in range(args.warmup, args.warmup + args.steps))
    ms = comm.allgather(np.array([spent / args.steps * 1e3,
                                  (ex.table_seconds - t0_tables) / args.steps * 1e3]),
                        op="exchange:ms")
    record = {"impl": "exchange", "world_size": world, "global_batch_size": args.batch_size,
              "hidden": list(args.hidden),
              "samples_per_sec": args.batch_size / (ms[:, 0].max() / 1e3), "eval_auc": None,
              "threads_per_rank": args.threads, "c_threads": c_threads(),
              "ms_per_step": {"total": float(ms[:, 0].mean()), "tables": float(ms[:, 1].mean())}}
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


def baseline(args, comm, tf, keras, build_deepfm, loss_obj, adam, gather=False):
    """Fixed-vocabulary DeepFM trained the Horovod way. Returns (train_step, predict)."""
    from train import DEFAULTS

    vocab = args.baseline_vocab

    class HashedEmbedding(keras.layers.Layer):
        def __init__(self, width, **kw):
            super().__init__(**kw)
            self.emb = keras.layers.Embedding(
                vocab, width, embeddings_initializer=keras.initializers.RandomNormal(
                    0.0, DEFAULTS["init_std"]))

        def call(self, ids):
            ids = tf.math.floormod(ids, vocab)
            if gather:  # ResourceGather: reads only the batch's rows
                if not self.emb.built:
                    self.emb.build(ids.shape)
                return tf.nn.embedding_lookup(self.emb.embeddings.value, ids)
            return self.emb(ids)

        def compute_output_spec(self, ids):
            return keras.KerasTensor(tuple(ids.shape) + (self.emb.output_dim,), "float32")

    model = build_deepfm(NUM_FIELDS, NUM_NUMERIC, args.dim, lambda f, w: HashedEmbedding(w),
                         hidden=args.hidden)
    emb_vars = [v for v in model.trainable_variables if "embeddings" in v.path]
    dense_vars = [v for v in model.trainable_variables if "embeddings" not in v.path]
    flat0 = np.concatenate([v.numpy().ravel() for v in dense_vars])
    flat0 = comm.bcast(flat0, 0)
    at = 0
    for v in dense_vars:
        n = int(np.prod(v.shape))
        v.assign(flat0[at:at + n].reshape(v.shape))
        at += n
    for v in emb_vars:  # same start on every rank (Horovod's broadcast_variables)
        v.assign(comm.bcast(v.numpy(), 0))
    adam.build(dense_vars)
    accums = [tf.Variable(tf.fill(v.shape, DEFAULTS["sparse_init_accum"])) for v in emb_vars]
    lr = tf.constant(DEFAULTS["sparse_lr"], tf.float32)
    eps = tf.constant(1e-7, tf.float32)
    width = args.dim + 1
    spec = {f"C{i + 1}": tf.TensorSpec([None], tf.int64) for i in range(NUM_FIELDS)}
    spec["numeric"] = tf.TensorSpec([None, NUM_NUMERIC], tf.float32)

    @tf.function(input_signature=[spec, tf.TensorSpec([None], tf.float32)])
    def grads_fn(inputs, labels):
        with tf.GradientTape() as tape:
            out = model(inputs, training=True)
            loss_sum = tf.reduce_sum(loss_obj.call(labels[:, None], out))
        g = tape.gradient(loss_sum, dense_vars + emb_vars)
        dense = g[:len(dense_vars)]
        sparse = g[len(dense_vars):]
        idx = tf.concat([tf.cast(s.indices, tf.int64) + i * vocab for i, s in enumerate(sparse)], 0)
        val = tf.concat([s.values for s in sparse], 0)
        return loss_sum, dense, idx, val

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([None, width], tf.float32)])
    def apply_sparse(idx, val):
        field = idx // vocab
        for i, (v, acc) in enumerate(zip(emb_vars, accums)):
            mask = tf.equal(field, i)
            rows = tf.boolean_mask(idx, mask) - i * vocab
            vals = tf.boolean_mask(val, mask)
            uniq, pos = tf.unique(rows)
            summed = tf.math.unsorted_segment_sum(vals, pos, tf.shape(uniq)[0])
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=v.handle, accum=acc.handle, lr=lr, epsilon=eps, grad=summed, indices=uniq)

    @tf.function(input_signature=[[tf.TensorSpec(v.shape, tf.float32) for v in dense_vars]])
    def apply_dense(gs):
        adam.apply_gradients(zip(gs, dense_vars))

    @tf.function(input_signature=[spec])
    def predict_fn(inputs):
        return model(inputs, training=False)

    def train_step(feats, labels):
        inputs = {k: tf.constant(v) for k, v in feats.items()}
        loss_sum, dense, idx, val = grads_fn(inputs, tf.constant(labels))
        n = np.array([labels.shape[0], float(loss_sum)], np.float32)
        flat = np.concatenate([np.asarray(g).ravel() for g in dense] + [n])
        total = comm.allreduce(flat, op="allreduce:dense")      # Horovod: fused allreduce
        n_total, loss_total = total[-2], total[-1]
        all_idx, _ = comm.allgatherv(np.asarray(idx), op="allgather:indices")
        all_val, _ = comm.allgatherv(np.asarray(val), op="allgather:values")
        apply_sparse(tf.constant(all_idx), tf.constant(all_val / n_total))
        g = total[:-2] / n_total
        gs, at = [], 0
        for v in dense_vars:
            k = int(np.prod(v.shape))
            gs.append(tf.constant(g[at:at + k].reshape(v.shape)))
            at += k
        apply_dense(gs)
        return loss_total / n_total

    def predict(feats):
        return predict_fn({k: tf.constant(v) for k, v in feats.items()}).numpy()

    return train_step, predict


if __name__ == "__main__":
    main()
