"""End-to-end demonstration of kvcoll's sharded tables on N MPI ranks.

Two tables ("user", dim 16 and "item", dim 8) are sharded over the ranks by a hash
of the id. Each step, every rank draws its slice of a global batch of Zipf ids
(the global batch depends only on --seed and the step), pulls the rows from their
owners in one fused all-to-all, computes the gradient of a regression loss towards
a planted vector per id, and pushes the gradients back to the owners, which apply
Adagrad in C. The loss falls as the tables learn the planted vectors. At the end
every rank checks that the tables hold exactly the distinct ids of all batches.

    mpirun -np 2 python examples/sharded_tables.py --steps 200
"""

import argparse
import time

import numpy as np

import kvcoll as kv  # kvcoll:
from kvcoll.exchange import BspExchange
from kvcoll.runtime import comm as kv_comm
from kvcoll.ids import hash64

DIMS = {"user": 16, "item": 8}


def planted(ids: np.ndarray, dim: int) -> np.ndarray:
    """The vector each id should learn: fixed, derived from the id alone."""
    h = hash64(ids)[:, None] ^ (np.arange(dim, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    h = (h * np.uint64(0xBF58476D1CE4E5B9)) >> np.uint64(40)
    return (h.astype(np.float32) / np.float32(2**24) - 0.5).astype(np.float32)


def global_batch(seed: int, step: int, size: int, vocab: int):
    rng = np.random.default_rng([seed, step])
    return {name: (rng.zipf(1.2, size) % vocab).astype(np.int64) for name in DIMS}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8192, help="global batch")
    p.add_argument("--vocab", type=int, default=10**6)
    p.add_argument("--seed", type=int, default=0)
    args, _ = p.parse_known_args()

    kv.init()  # kvcoll: MPI up, private communicator
    rank, world = kv.rank(), kv.size()  # kvcoll:
    tables = {name: kv.KvTable(dim, name=name, seed=args.seed,  # kvcoll: one shard per rank
                               initializer=("normal", 0.0, 0.05),
                               optimizer=kv.optimizers.Adagrad(0.5))
              for name, dim in DIMS.items()}
    ex = BspExchange(kv_comm(), tables)  # kvcoll:
    lo, hi = (rank * args.batch_size) // world, ((rank + 1) * args.batch_size) // world

    t0 = time.perf_counter()
    losses = []
    for step in range(1, args.steps + 1):
        batch = {n: ids[lo:hi] for n, ids in global_batch(args.seed, step, args.batch_size,
                                                          args.vocab).items()}
        pulled = ex.pull(batch)  # kvcoll: step `step`: the rows of this batch's unique ids
        grads, loss = {}, 0.0
        for name, p_ in pulled.items():
            diff = p_.rows - planted(p_.uniq, DIMS[name])           # per unique id
            mult = np.bincount(p_.inverse, minlength=p_.uniq.size)  # occurrences in batch
            loss += float((mult[:, None] * diff**2).sum()) / 2 / args.batch_size
            grads[name] = (mult[:, None] * diff / args.batch_size).astype(np.float32)
        ex.push(pulled, grads).commit()  # kvcoll: gradients to their owners, Adagrad in C
        loss = float(kv_comm().allreduce(np.array([loss]))[0])  # kvcoll:
        losses.append(loss)
        if rank == 0 and (step == 1 or step % 25 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss:.5f}", flush=True)
    elapsed = time.perf_counter() - t0

    # Check: every id of every batch has exactly one row, on its owner.
    seen = {n: set() for n in DIMS}
    for step in range(1, args.steps + 1):
        for n, ids in global_batch(args.seed, step, args.batch_size, args.vocab).items():
            seen[n].update(np.unique(ids).tolist())
    rows = {n: int(kv_comm().allreduce(np.array([len(t)], np.int64))[0])
            for n, t in tables.items()}
    ok = all(rows[n] == len(seen[n]) for n in DIMS)
    stats = {n: t.stats() for n, t in tables.items()}
    if rank == 0:
        ids_per_s = args.steps * args.batch_size * len(DIMS) / elapsed
        print(f"{world} ranks, {args.steps} steps of {args.batch_size} ids x {len(DIMS)} "
              f"tables in {elapsed:.2f}s: {ids_per_s:,.0f} ids/s")
        print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} "
              f"({losses[-1] / losses[0]:.1%} of the first step)")
        for n in DIMS:
            print(f"table {n!r}: {rows[n]:,} rows over all ranks (expected {len(seen[n]):,}), "
                  f"rank 0 holds {stats[n].rows:,} rows, {stats[n].bytes / 2**20:.1f} MiB, "
                  f"{stats[n].bytes_per_row_overhead:.1f} B/row beyond its floats")
        print("check:", "OK" if ok and losses[-1] < 0.5 * losses[0] else "FAILED")
    for t in tables.values():
        t.close()
    kv.shutdown()  # kvcoll:
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
