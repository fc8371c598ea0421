"""One launch of `python -m bench scale` (bench/scale_bench.py). Two modes:

--mode net (2 ranks): this MPI's figures between rank 0 and rank 1, the inputs of the
  scale model's links:
  - ping-pong of k small (8-byte) messages each way, k = 1, 4, 16, 64 (raw mpi4py,
    Isend/Irecv + Waitall): half a round trip = stage + k x message, so the slope is the
    seconds a message adds and the intercept a stage's latency;
  - kvcoll's own all-to-all stage (Comm.alltoallv with known receive counts, as the
    rows and gradients go): a tiny one (one message each way: a stage through kvcoll's
    waits) and a large one (--big-bytes to the peer: the bandwidth).
--mode step: kvcoll's step loop (kvcoll.step.Loop over a BspExchange, not pipelined)
  with a numpy compute: F fields of one table (dim --dim, Adagrad), the rows concatenated
  into a one-hidden-layer MLP (--hidden, ReLU, logistic loss), whose weights are the
  dense gradient the loop allreduces. Every rank trains --batch samples a step (weak
  scaling: the per-rank batch is fixed). Per rank: the loop's own phase timers
  (Loop.timings: exchange, tables, compute, allreduce, apply; seconds per step after
  --warmup), the wall seconds per step, the messages per step (Comm.messages), the bytes
  sent (BspExchange.wire_bytes), the unique ids per step, the rank's CPU seconds per
  step and the whole machine's busy cores over the timed steps (so the bench knows what
  other processes used meanwhile: the machine is shared).

Rank 0 prints one `@@record {json}` line. TensorFlow-free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# one BLAS thread a rank (before numpy loads it): the ranks share the machine's cores, and
# a BLAS pool per rank would oversubscribe them and spin (as bench/common.run_child does)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import numpy as np

import kvcoll as kv
from kvcoll import runtime
from kvcoll.exchange import BspExchange
from kvcoll.step import Grads, Loop


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def net(args) -> dict:
    from mpi4py import MPI

    kv.init(argv=[])
    comm = runtime.comm()
    if comm.size != 2:
        raise SystemExit(f"--mode net runs on 2 ranks, not {comm.size}")
    w = MPI.COMM_WORLD.Dup()
    me, peer = w.Get_rank(), 1 - w.Get_rank()
    out = {"pingpong": {}}
    for k in (1, 4, 16, 64):
        bufs = [np.zeros(1, np.int64) for _ in range(k)]

        def once(k=k, bufs=bufs):
            if me == 0:
                MPI.Request.Waitall([w.Isend(b, peer, tag=i) for i, b in enumerate(bufs)])
                MPI.Request.Waitall([w.Irecv(b, peer, tag=i) for i, b in enumerate(bufs)])
            else:
                MPI.Request.Waitall([w.Irecv(b, peer, tag=i) for i, b in enumerate(bufs)])
                MPI.Request.Waitall([w.Isend(b, peer, tag=i) for i, b in enumerate(bufs)])
        for _ in range(50):
            once()
        w.Barrier()
        out["pingpong"][k] = _median_time(once, args.reps) / 2
    ks = sorted(out["pingpong"])
    ys = [out["pingpong"][k] for k in ks]
    slope, icept = np.polyfit(ks, ys, 1)
    out["raw_message_s"], out["raw_stage_s"] = float(max(slope, 0.0)), float(icept)
    # kvcoll's all-to-all stage: tiny, then large (one block for the peer)
    for name, n in (("tiny", 1), ("big", args.big_bytes // 8)):
        send = np.arange(2 * n, dtype=np.int64)
        counts = np.array([n, n], np.int64)

        def stage(send=send, counts=counts):
            comm.alltoallv(send, counts, op="scale:probe", recv_counts=counts).wait()
        for _ in range(20 if n > 1 else 200):
            stage()
        comm.barrier()
        out[f"kv_{name}_s"] = _median_time(stage, args.reps if n == 1 else max(10, args.reps // 20))
        out[f"kv_{name}_bytes"] = 8 * n
    out["kv_bandwidth"] = out["kv_big_bytes"] / max(out["kv_big_s"] - out["kv_tiny_s"], 1e-9)
    # a stage through kvcoll = its latency + one message
    out["kv_stage_s"] = max(out["kv_tiny_s"] - out["raw_message_s"], 0.0)
    both = comm.allgather_json(out, op="scale:gather")
    w.Free()
    kv.shutdown()
    return {"ranks": both, "world": 2}


class _Batch:
    def __init__(self, ids, y):
        self.ids, self.y, self.n = ids, y, len(y)


class MLP:
    """The step's compute: rows of F fields -> ReLU(x W1 + b1) w2 + b2 -> logistic loss."""

    dense_slots = 0

    def __init__(self, fields: int, dim: int, hidden: int, lr: float = 0.01):
        rng = np.random.default_rng(0)
        self.F, self.d, self.h, self.lr = fields, dim, hidden, lr
        self.W1 = (rng.standard_normal((fields * dim, hidden)) * 0.05).astype(np.float32)
        self.b1 = np.zeros(hidden, np.float32)
        self.w2 = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
        self.b2 = np.zeros(1, np.float32)
        self.n_dense = self.W1.size + hidden + hidden + 1
        self._state = np.zeros(2, np.float32)

    def prepare(self, element, x_only=False):
        ids, y = element
        return _Batch({"emb": np.asarray(ids, np.int64).reshape(-1)}, np.asarray(y, np.float32))

    def ids(self, batch):
        return {"emb": batch.ids["emb"] if batch is not None else np.zeros(0, np.int64)}

    def train(self, batch, pull, weight):
        rows, pos = pull.rows[f"dim{self.d}"], pull.pos["emb"]
        n = batch.n
        x = rows[pos].reshape(n, self.F * self.d)
        z = x @ self.W1 + self.b1
        h = np.maximum(z, 0)
        logit = h @ self.w2 + self.b2[0]
        p = 1 / (1 + np.exp(-logit))
        y = batch.y
        loss = float(-np.mean(y * np.log(p + 1e-7) + (1 - y) * np.log(1 - p + 1e-7)))
        d = ((p - y) / n * weight).astype(np.float32)
        gw2 = h.T @ d
        dh = np.outer(d, self.w2) * (z > 0)
        gW1 = x.T @ dh
        dx = (dh @ self.W1.T).reshape(-1, self.d)
        grows = np.zeros_like(rows)
        np.add.at(grows, pos, dx)
        dense = np.concatenate([gW1.reshape(-1), dh.sum(0), gw2, [d.sum()]]).astype(np.float32)
        state = self._state + np.array([loss * n, n], np.float32)
        return Grads(loss * weight, dense, {f"dim{self.d}": grows}, state)

    def zero_grads(self, pull):
        return Grads(0.0, np.zeros(self.n_dense, np.float32),
                     {g: np.zeros_like(m) for g, m in pull.rows.items()}, self._state)

    def state(self):
        return self._state

    def set_state(self, state):
        self._state = np.asarray(state, np.float32)

    def apply(self, dense_sum, state, step):
        if dense_sum is not None:
            g = np.asarray(dense_sum, np.float32)
            k = self.W1.size
            self.W1 -= self.lr * g[:k].reshape(self.W1.shape)
            self.b1 -= self.lr * g[k:k + self.h]
            self.w2 -= self.lr * g[k + self.h:k + 2 * self.h]
            self.b2 -= self.lr * g[-1:]
        return {"loss": float(state[0] / max(state[1], 1))}

    def logs(self, state):
        return {"loss": float(state[0] / max(state[1], 1))}

    def rates(self, step):
        return None, None

    def dense_values(self):
        return None, None, 0

    def set_dense_values(self, flat, state=None, updates=None):
        pass

    def explain(self, batch):
        return None


def step(args) -> dict:
    kv.init(argv=[])
    comm = runtime.comm()
    table = kv.KvTable(args.dim, name="emb", seed=3, initializer=("normal", 0.0, 0.05),
                       optimizer=kv.optimizers.Adagrad(0.05))
    compute = MLP(args.fields, args.dim, args.hidden)
    ex = BspExchange(comm, {"emb": table}, wire_dtype=args.wire)
    loop = Loop(ex, compute)
    me = comm.rank
    uniques = []

    # a pool of batches made before the timed steps (cycled), so that no data work of one
    # rank delays the others inside the timed phases
    pool = []
    for k in range(args.pool):
        rng = np.random.default_rng([11, k, me])
        ids = (rng.zipf(args.zipf, (args.batch, args.fields)) % args.vocab
               + np.arange(args.fields) * args.vocab).astype(np.int64)
        pool.append((ids, (ids[:, 0] % 2).astype(np.float32)))
        uniques.append(int(np.unique(ids).size))

    def batches():
        while True:
            yield pool[loop.step % len(pool)]
    it = batches()
    t0 = None
    msgs0 = bytes0 = tm0 = None
    while loop.step < args.warmup + args.steps:
        if loop.step == args.warmup:
            comm.barrier("scale:timed")
            t0 = time.perf_counter()
            msgs0, bytes0, tm0 = dict(comm.messages), dict(ex.wire_bytes), dict(loop.timings)
            cpu0, stat0 = time.process_time(), _machine_busy()
        loop.train_next(it)
    wall = time.perf_counter() - t0
    cpu, stat1 = time.process_time() - cpu0, _machine_busy()
    # the whole machine's busy cores over the timed steps (/proc/stat is not per
    # namespace): with every rank's own CPU, what the other processes used meanwhile
    busy = (os.cpu_count() or 1) * (stat1[0] - stat0[0]) / max(1, stat1[1] - stat0[1])
    n = args.steps
    mine = {"rank": me, "wall_s": wall / n, "cpu_s": cpu / n, "machine_busy_cores": busy,
            "timings_s": {k: (loop.timings[k] - tm0.get(k, 0.0)) / n for k in loop.timings
                          if k != "tables"},
            "tables_s": (loop.timings["tables"] - tm0.get("tables", 0.0)) / n,
            "messages": {k: (v - msgs0.get(k, 0)) / n for k, v in comm.messages.items()
                         if v - msgs0.get(k, 0)},
            "wire_bytes": {k: (v - bytes0.get(k, 0)) / n for k, v in ex.wire_bytes.items()},
            "unique_ids": statistics.mean(uniques),
            "host": comm.hosts[me]}
    every = comm.allgather_json(mine, op="scale:gather")
    t = comm.topology
    rec = {"world": comm.size, "topology": {"mode": t.mode, "shape": [t.hosts, t.per_host]},
           "batch": args.batch, "fields": args.fields, "dim": args.dim, "hidden": args.hidden,
           "n_dense": compute.n_dense, "wire": args.wire, "steps": n, "ranks": every}
    ex.close()
    table.close()
    kv.shutdown()
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("net", "step"), required=True)
    p.add_argument("--reps", type=int, default=2000, help="net: timed repetitions")
    p.add_argument("--big-bytes", type=int, default=8 << 20, help="net: the large stage")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=100_000, help="ids per field")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--pool", type=int, default=24, help="distinct batches, cycled")
    p.add_argument("--wire", choices=("fp32", "fp16"), default="fp32")
    args = p.parse_args(argv)
    rec = net(args) if args.mode == "net" else step(args)
    if _rank() == 0:
        print("@@record " + json.dumps(rec), flush=True)
    return 0


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far (/proc/stat's first line)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


def _rank() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


if __name__ == "__main__":
    raise SystemExit(main())
