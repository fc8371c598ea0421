"""One launch of `python -m bench topology` (bench/topology_bench.py): the same BSP
exchange steps over two communicators of the same ranks, taken in turn (which goes first
alternates every step), so that both see the same machine load:

- kvcoll's own communicator (kv.init's: two-level where the hosts allow it; the runner
  checks that it is), and
- a flat one (kvcoll.comm.Comm(topology="flat")).

Each has its own tables (two tables of dim 16, Adagrad) and gets the same ids: per step
every rank pulls --batch-size Zipf-like ids per table, pushes a gradient and commits. Per
step and communicator: the seconds of the pull (id and row all-to-alls) and of the push
(gradient all-to-all, allreduce, apply), every rank's; and the messages each phase sent
(Comm.messages). At the end the two table sets must be equal bit for bit. Rank 0 prints
one `@@record {json}` line. TensorFlow-free.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import kvcoll as kv
from kvcoll import runtime
from kvcoll.comm import Comm
from kvcoll.exchange import BspExchange

DIMS = {"user": 16, "item": 16}
PHASES = ("pull:ids", "pull:rows", "push:grads")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=2048, help="ids per table per rank")
    p.add_argument("--vocab", type=int, default=200_000)
    args = p.parse_args(argv)
    cfg = kv.init(argv=[])
    own = runtime.comm()
    flat = Comm(timeout=cfg.comm_timeout, timeouts=cfg.timeouts, topology="flat")
    runs = {}
    for name, c in (("kvcoll", own), ("flat", flat)):
        tables = {n: kv.KvTable(d, name=n, seed=3, initializer=("normal", 0.0, 0.05),
                                optimizer=kv.optimizers.Adagrad(0.1)) for n, d in DIMS.items()}
        runs[name] = (c, BspExchange(c, tables), tables)
    secs = {name: {"pull": [], "push": []} for name in runs}
    msgs = {name: {ph: 0 for ph in PHASES} for name in runs}
    me = own.rank
    for step in range(1, args.steps + 1):
        rng = np.random.default_rng([7, step, me])
        ids = {n: (rng.zipf(1.3, args.batch_size) % args.vocab).astype(np.int64) for n in DIMS}
        for name in (list(runs) if step % 2 else list(reversed(runs))):
            c, ex, _ = runs[name]
            c.barrier("bench:together")
            before = dict(c.messages)
            t0 = time.perf_counter()
            pull = ex.pull(ids)
            t1 = time.perf_counter()
            pushed = ex.push(pull, {g: (m * 0.01).astype(np.float32)
                                    for g, m in pull.rows.items()})
            pushed.reduced()
            pushed.commit()
            t2 = time.perf_counter()
            if step > args.warmup:
                secs[name]["pull"].append(t1 - t0)
                secs[name]["push"].append(t2 - t1)
                for ph in PHASES:
                    msgs[name][ph] += c.messages.get(ph, 0) - before.get(ph, 0)
    same = True
    for n in DIMS:
        a, b = runs["kvcoll"][2][n].export(), runs["flat"][2][n].export()
        same &= all(a[k].tobytes() == b[k].tobytes() for k in ("keys", "values", "slots"))
    ok = flat.allgather(np.array([1 if same else 0], np.int64))[:, 0]
    mine = {"rank": me, "secs": secs, "msgs": msgs}
    every = flat.allgather_json(mine, op="bench:gather")
    if me == 0:
        t = own.topology
        print("@@record " + json.dumps({
            "topology": {"mode": t.mode, "shape": [t.hosts, t.per_host], "why": t.why},
            "world": own.size, "steps": args.steps - args.warmup,
            "batch_size": args.batch_size, "tables_equal": bool(ok.all()), "ranks": every}),
            flush=True)
    for _, ex, tables in runs.values():
        ex.close()
        for tb in tables.values():
            tb.close()
    flat.barrier()
    flat.free()
    kv.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
