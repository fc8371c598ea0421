"""fp32 / fp16 / bf16 rows on the wire in one launch, run under mpirun by bench/wire_bench.py.

    mpirun -np 2 python bench/wire_worker.py --steps 400 --out r.json

The demo's model (examples/train.py: DeepFM, its defaults) three times in one process,
one kv.Trainer per wire dtype (kv.Trainer(wire_dtype=...)), with the same initial
weights, each over its own iterator of the same SyntheticCTR batches (the pipelined loop,
train_next, as model.fit runs it by default). They step in blocks of --block steps,
the order of the three rotating every round (fp32 fp16 bf16, fp16 bf16 fp32, ...), a
barrier around each block, so all three see the machine's load alike; a round's
ratio is a 16-bit block's speed over the fp32 block's of the same round.

Per dtype it records: samples/s (median block), the ratios to fp32, ms per step in the
exchange (the loop's timings), the bytes every rank sent to the others per step (ids,
rows, row gradients: the exchange's wire_bytes, summed over ranks), the dense
gradient's allreduce size, the final training loss and the AUC on a fixed held-out set
(the same samples for the three, never trained on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from train_worker import NUM_FIELDS, NUM_NUMERIC, features  # noqa: E402

WIRES = ("fp32", "fp16", "bf16")


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400, help="timed steps per dtype")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--block", type=int, default=10, help="steps a block")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--dim", type=int, default=8, help="FM width (rows are dim + 1 wide)")
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    p.add_argument("--eval-samples", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import kvcoll as kv
    from kvcoll import runtime
    from kvcoll.data import SyntheticCTR, auc

    kv.init(argv=[])
    comm = runtime.comm()
    rank, world = comm.rank, comm.size
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from models import build_deepfm
    from train import DEFAULTS

    hidden = tuple(int(u) for u in args.hidden.split(",") if u.strip())
    data = SyntheticCTR(seed=args.seed, vocab=10**7)
    loss = keras.losses.BinaryCrossentropy(from_logits=True)

    def make(wire):
        keras.utils.set_random_seed(args.seed)          # the three start alike
        model = kv.distribute(build_deepfm(
            NUM_FIELDS, NUM_NUMERIC, args.dim, lambda f, w: kv.Embedding(
                f, w, initializer=("normal", 0.0, DEFAULTS["init_std"]), seed=args.seed),
            hidden=hidden))
        opt = kv.DistributedOptimizer(
            keras.optimizers.Adam(DEFAULTS["lr"]),
            sparse=kv.optimizers.Adagrad(DEFAULTS["sparse_lr"],
                                         initial_accumulator_value=DEFAULTS["sparse_init_accum"]))
        trainer = kv.Trainer(model, loss, opt, wire_dtype=wire)
        kv.broadcast_variables(model.variables, root_rank=0, comm=comm)
        return trainer

    trainers = {w: make(w) for w in WIRES}

    def stream():
        for step in range(args.warmup + args.steps):
            b = data.batch(step, args.batch_size, rank, world)
            yield features(b), b["label"]

    its = {w: stream() for w in WIRES}
    last = {}

    def block(w, n):
        for _ in range(n):
            last[w] = trainers[w].train_next(its[w])

    for w in WIRES:
        block(w, args.warmup)
    sent0 = {w: dict(trainers[w].engine.loop.ex.wire_bytes) for w in WIRES}
    tm0 = {w: dict(trainers[w].timings) for w in WIRES}
    seconds = {w: [] for w in WIRES}
    rounds = args.steps // args.block
    for k in range(rounds):
        order = WIRES[k % 3:] + WIRES[:k % 3]
        for w in order:
            comm.barrier()
            t0 = time.perf_counter()
            block(w, args.block)
            comm.barrier()
            seconds[w].append(time.perf_counter() - t0)
    steps = rounds * args.block
    # before evaluation (whose lookups send ids and rows too)
    sent1 = {w: dict(trainers[w].engine.loop.ex.wire_bytes) for w in WIRES}
    tm1 = {w: dict(trainers[w].timings) for w in WIRES}
    ev = data.eval_set(args.eval_samples, rank, world)
    labels, _ = comm.allgatherv(ev["label"].astype(np.float32))
    out = {}
    for w in WIRES:
        t = trainers[w]
        preds = np.asarray(t.predict(features(ev)), np.float32).reshape(-1)
        all_preds, _ = comm.allgatherv(preds)
        sent = np.array([sent1[w][k] - sent0[w][k] for k in ("ids", "rows", "grads")],
                        np.float64)
        sent = comm.allreduce(sent, op="wire-bytes") / steps      # every rank's, per step
        ms = {k: (tm1[w][k] - tm0[w][k]) / steps * 1e3 for k in ("exchange", "compute",
                                                                  "allreduce", "apply")}
        out[w] = {
            "samples_per_sec": args.block * args.batch_size / statistics.median(seconds[w]),
            "block_seconds": seconds[w],
            "bytes_per_step": {"ids": float(sent[0]), "rows": float(sent[1]),
                               "grads": float(sent[2]), "total": float(sent.sum())},
            "dense_allreduce_bytes": 4 * int(t.engine.compute.n_dense),
            "ms_per_step": ms,
            "final_loss": float(last[w]),
            "eval_auc": auc(labels, all_preds),
            "row_floats": args.dim + 1,
        }
    for w in WIRES[1:]:
        ratios = [a / b for a, b in zip(seconds["fp32"], seconds[w])]   # w's speed / fp32's
        out[w]["ratios_to_fp32"] = ratios
        out[w]["ratio_to_fp32"] = statistics.median(ratios)
    record = {"world_size": world, "threads_per_rank": args.threads,
              "global_batch_size": args.batch_size, "dim": args.dim, "hidden": list(hidden),
              "block": args.block, "steps": steps, "warmup": args.warmup,
              "eval_samples": args.eval_samples,
              "planted_auc": data.planted_auc(args.eval_samples), "wires": out}
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))
    kv.shutdown()


if __name__ == "__main__":
    main()
