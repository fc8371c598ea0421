"""A training-shaped job for the fault tests, without TensorFlow (so it starts in a
fraction of a second): every rank runs kvcoll's exchange of the run's step mode (BSP,
SSP or ASP: --step-mode, --staleness) over two tables and a dense vector, step after
step, until it is stopped or --steps is reached. Each step pulls the rows of this
rank's slice of global batch `step` from their owners, and pushes gradients (towards
zero) for those rows and for the dense vector, as kvcoll's training loop does between
its TensorFlow steps; the same communicator code, deadlines and errors.

Prints "rank R pid P host H" once, "rank R step S" every --log-every steps, and
"rank R done" at the end. With --error-dir, a rank that raises also writes the error to
DIR/rank-R.txt (a rank on a host cut off from the launcher cannot print to it).

    mpirun -np 3 python tests/launch/fault_job.py --step-mode ssp --staleness 2
"""

import argparse
import os
import socket
import sys
import time

import numpy as np

import kvcoll as kv
from kvcoll.exchange import make_exchange
from kvcoll.runtime import comm as kv_comm

DIMS = {"user": 8, "item": 4}
DENSE = 64


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--batch-size", type=int, default=512, help="global batch")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-ms", type=float, default=5.0, help="sleep per step (compute)")
    p.add_argument("--error-dir", help="write a rank's error to DIR/rank-R.txt")
    args, _ = p.parse_known_args(argv)
    try:
        return run(args)
    except BaseException as exc:
        if args.error_dir and kv.is_initialized():
            path = os.path.join(args.error_dir, f"rank-{kv.rank()}.txt")
            with open(path, "w") as f:
                f.write(f"{type(exc).__name__}: {exc}\n")
        raise


def run(args) -> int:
    cfg = kv.init()  # --step-mode / --staleness / KVCOLL_* from the command line
    rank, world = kv.rank(), kv.size()
    comm = kv_comm()
    print(f"rank {rank} pid {os.getpid()} host {socket.gethostname()} "
          f"local {kv.local_rank()}/{kv.local_size()}", flush=True)
    tables = {n: kv.KvTable(d, name=n, initializer=("normal", 0.0, 0.05),
                            optimizer=kv.optimizers.Adagrad(0.1)) for n, d in DIMS.items()}
    ex = make_exchange(comm, tables, cfg.mode, dense_size=DENSE,
                       dense_optimizer=kv.optimizers.Adagrad(0.1))
    if not ex.synchronous:
        ex.start_dense(np.zeros(DENSE, np.float32))
    lo, hi = rank * args.batch_size // world, (rank + 1) * args.batch_size // world
    while ex.step < args.steps:
        step = ex.step + 1
        rng = np.random.default_rng([7, step])
        ids = {n: rng.integers(0, 100_000, args.batch_size)[lo:hi].astype(np.int64)
               for n in DIMS}
        pulled = ex.pull(ids, dense=True)
        grads = {g: 0.01 * rows for g, rows in pulled.rows.items()}
        pushed = ex.push(pulled, grads, np.full(DENSE, 0.01, np.float32),
                         np.array([1.0], np.float32))
        pushed.reduced()
        pushed.commit()
        if step % args.log_every == 0:
            print(f"rank {rank} step {step}", flush=True)
        time.sleep(args.step_ms / 1e3)
    if not ex.synchronous:
        ex.finish()  # SSP/ASP: every rank's updates applied everywhere
    print(f"rank {rank} done", flush=True)
    if hasattr(ex, "close"):
        ex.close()
    for t in tables.values():
        t.close()
    kv.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
