"""A training job for the elastic tests, without TensorFlow (it starts in a fraction of a
second): kvcoll's step loop (kvcoll.step.Loop) over two tables and a small dense vector
(a linear model on the rows, computed in numpy), checkpoints through
kvcoll.checkpoint.Checkpointer, and, under the elastic launcher, every step and save in
a kvcoll.elastic.Session, as kv.Model's fit runs them.

The global batch of step t depends on --seed and t alone; each rank takes its even part
of it for the world it is in when it reads it (kv.rank(), kv.size()), so after a lost
rank the survivors continue on the same global batches, each a larger part.

    kvcollrun --elastic --min-np 2 -np 3 python elastic_job.py --steps 60 --ckpt D \\
        --full-every 20 --incremental-every 5 --losses L.json

Prints "step S loss L" on rank 0 every step (and "rank R step S" every --log-every steps
on every rank), "rank R done" at the end. Test hooks: --dump DIR writes the recovered
state as a full checkpoint right after a recovery (a Checkpointer of its own; the run's
next save is then full); --save-at S --save-dir D saves a full checkpoint at step S;
--kill-rank R --kill-at S: rank R kills itself (SIGKILL) after step S.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

import kvcoll as kv
from kvcoll import elastic, runtime
from kvcoll.checkpoint import Checkpointer, latest
from kvcoll.data import even_split
from kvcoll.exchange import make_exchange
from kvcoll.step import Grads, Loop

DIMS = {"user": 8, "item": 4}
VOCAB = {"user": 50_000, "item": 20_000}
LR = 0.05


class Batch:
    def __init__(self, ids, y):
        self.ids, self.y, self.n = ids, y, len(y)


class Linear:
    """p = sigmoid(sum over tables of row(id) . w_table): the compute of kvcoll.step."""

    dense_slots = 0

    def __init__(self):
        self.w = np.full(sum(DIMS.values()), 0.1, np.float32)
        self.n_dense = self.w.size
        self._state = np.zeros(2, np.float32)

    def prepare(self, element, x_only=False):
        ids, y = element
        return Batch({n: np.asarray(ids[n], np.int64) for n in DIMS}, np.asarray(y, np.float32))

    def ids(self, batch):
        return {n: batch.ids[n] if batch is not None else np.zeros(0, np.int64) for n in DIMS}

    def _parts(self, pull):
        out, at = [], 0
        for n, d in DIMS.items():
            out.append((n, pull.rows[f"dim{d}"], pull.pos[n], self.w[at:at + d], at))
            at += d
        return out

    def _logit(self, batch, pull):
        return sum(rows[pos] @ w for _, rows, pos, w, _ in self._parts(pull))

    def train(self, batch, pull, weight):
        p = 1 / (1 + np.exp(-self._logit(batch, pull)))
        y = batch.y
        eps = 1e-7
        loss = float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
        d = ((p - y) / batch.n * weight).astype(np.float32)
        dense = np.zeros_like(self.w)
        grads = {g: np.zeros_like(m) for g, m in pull.rows.items()}
        for n, rows, pos, w, at in self._parts(pull):
            dense[at:at + w.size] = (rows[pos] * d[:, None]).sum(0)
            np.add.at(grads[f"dim{DIMS[n]}"], pos, d[:, None] * w[None])
        state = self._state + np.array([loss * batch.n, batch.n], np.float32)
        return Grads(loss * weight, dense, grads, state)

    def zero_grads(self, pull):
        return Grads(0.0, np.zeros_like(self.w),
                     {g: np.zeros_like(m) for g, m in pull.rows.items()}, self._state)

    def state(self):
        return self._state

    def set_state(self, state):
        self._state = np.asarray(state, np.float32)

    def apply(self, dense_sum, state, step):
        if dense_sum is not None:
            self.w = (self.w - LR * dense_sum).astype(np.float32)
        return {"loss": float(state[0] / max(state[1], 1))}

    def logs(self, state):
        return {"loss": float(state[0] / max(state[1], 1))}

    def rates(self, step):
        return None, None

    def dense_values(self):
        return self.w.copy(), None, 0

    def set_dense_values(self, flat, state=None, updates=None):
        self.w = np.asarray(flat, np.float32).copy()

    def explain(self, batch):
        return None


class Dense:
    """The checkpoint's dense part: the compute's w (what kv.save's DenseState is)."""

    NAME = "dense.npy"

    def __init__(self, compute):
        self.c = compute

    def write(self, directory):
        with open(os.path.join(directory, self.NAME), "wb") as f:
            np.save(f, self.c.w)
        return [self.NAME]

    def check(self, directory):
        w = np.load(os.path.join(directory, self.NAME))
        if w.shape != self.c.w.shape:
            raise ValueError(f"dense shape {w.shape}, the model has {self.c.w.shape}")

    def read(self, directory):
        self.c.w = np.load(os.path.join(directory, self.NAME)).astype(np.float32)

    def snapshot(self):
        return self.c.w.copy()

    def rollback(self, values):
        self.c.w = values


def global_batch(seed: int, step: int, size: int):
    """Global batch `step`: ids (Zipf-like) and labels from a planted rule."""
    rng = np.random.default_rng([seed, step])
    ids = {n: (rng.zipf(1.3, size) % v).astype(np.int64) for n, v in VOCAB.items()}
    y = ((ids["user"] % 7 + ids["item"] % 3) % 2).astype(np.float32)
    return ids, y


def batches(loop, args):
    """Rank kv.rank()'s part of global batch loop.step + 1, for the world it is in now."""
    while True:
        ids, y = global_batch(args.seed, loop.step + 1, args.batch_size)
        lo, hi = even_split(args.batch_size, kv.rank(), kv.size())
        yield {n: a[lo:hi] for n, a in ids.items()}, y[lo:hi]


def die_in_wait(k: int) -> None:
    """From now on, this process kills itself (SIGKILL) in its k-th wait (0-based) of a
    collective or of the elastic vote, with its own part already posted."""
    from kvcoll.comm import Comm
    count = {"n": 0}

    def counted(method):
        def run(self, *a, **kw):
            if count["n"] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            count["n"] += 1
            return method(self, *a, **kw)
        return run
    Comm.wait = counted(Comm.wait)
    Comm.consensus = counted(Comm.consensus)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", help="checkpoint directory")
    p.add_argument("--full-every", type=int, default=0)
    p.add_argument("--incremental-every", type=int, default=0)
    p.add_argument("--restore", action="store_true", help="continue from --ckpt's latest")
    p.add_argument("--restore-from", help="restore this directory's latest at the start")
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--losses", help="rank 0 writes {step: loss} here at the end")
    p.add_argument("--events", help="rank 0 writes kvcoll.elastic.events() here at the end")
    p.add_argument("--dump", help="after a recovery, save the recovered state here")
    p.add_argument("--save-at", default="", help="steps (comma-separated)")
    p.add_argument("--save-dir")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--busy-rank", type=int, default=-1,
                   help="this rank computes outside kvcoll for --busy-s seconds at --busy-at "
                        "(holding the GIL: a long step)")
    p.add_argument("--busy-at", type=int, default=0)
    p.add_argument("--busy-s", type=float, default=0.0)
    p.add_argument("--stderr-dir", help="each rank also writes its stderr to DIR/rank-R.txt "
                                        "(a rank on a host cut off cannot reach the launcher)")
    p.add_argument("--kill-wait", type=int, default=-1,
                   help="with --kill-rank/--kill-at: die in the k-th wait of the next step "
                        "(a collective's wait or the elastic vote), its part posted")
    args, _ = p.parse_known_args(argv)

    faulthandler.register(signal.SIGUSR1, all_threads=True)   # (a test asks where it is)
    faulthandler.enable(all_threads=True)   # a crash prints where each thread was
    if args.stderr_dir:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "x")
        log = os.open(os.path.join(args.stderr_dir, f"rank-{rank}.txt"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)
    cfg = kv.init()
    comm = runtime.comm()
    tables = {n: kv.KvTable(d, name=n, initializer=("normal", 0.0, 0.05), seed=3,
                            optimizer=kv.optimizers.Adagrad(0.1)) for n, d in DIMS.items()}
    compute = Linear()
    # SSP/ASP: the dense vector lives in slices on their owners, updated there with SGD
    loop = Loop(make_exchange(comm, tables, cfg.mode, compute.n_dense,
                              kv.optimizers.SGD(LR)), compute)
    ck = Checkpointer(tables, comm, dense=Dense(compute), owners=loop.ex.owners)
    source = args.restore_from or (args.ckpt if args.restore else None)
    if source and latest(source):
        info = ck.restore(source)
        loop.set_step(info.step)
        if comm.rank == 0:
            print(f"restored {info.name} at step {info.step} on {comm.size} rank(s)",
                  flush=True)
    dumped = {"full": False}

    class Hooks:
        def on_world_change(self, old, new):
            print(f"world change {old} -> {new} at step {loop.step}", flush=True)
            if args.dump:
                c = Checkpointer(tables, loop.comm, dense=Dense(compute), owners=loop.ex.owners)
                c.save(args.dump, loop.step)
                dumped["full"] = True     # the dump cleared the dirty bits

    session = elastic.Session(loop, checkpointer=ck, directory=args.ckpt,
                              callbacks=lambda: [Hooks()]) \
        if elastic.enabled() and loop.synchronous else None    # (SSP/ASP: relaunched)

    def run(fn):
        return session.run(fn) if session is not None else fn()

    it = batches(loop, args)
    losses = {}
    t_warm, out = None, True
    while loop.step < args.steps:
        if loop.step == 50:
            t_warm = time.perf_counter()
        loop.stop_asked = runtime.preempted()  # kvcollrun asks (SIGUSR2): every rank stops
        out = run(lambda: loop.train_next(it))  # after the same step
        if out is None:
            break
        step = loop.step
        losses[step] = out.loss
        if kv.rank() == 0:
            print(f"step {step} loss {out.loss:.9g}", flush=True)
        if step % args.log_every == 0:
            print(f"rank {kv.rank()} step {step}", flush=True)
        if args.ckpt:
            full = args.full_every and step % args.full_every == 0
            delta = args.incremental_every and step % args.incremental_every == 0
            if full or delta:
                inc = bool(delta and not full and not dumped["full"])
                run(lambda inc=inc: ck.save(args.ckpt, loop.step, incremental=inc))
                dumped["full"] = False
        if str(step) in args.save_at.split(","):
            Checkpointer(tables, loop.comm, dense=Dense(compute),
                         owners=loop.ex.owners).save(os.path.join(args.save_dir, str(step)),
                                                     step)
        if kv.rank() == args.kill_rank and step == args.kill_at and \
                loop.comm.size == int(os.environ.get("OMPI_COMM_WORLD_SIZE", loop.comm.size)):
            if args.kill_wait < 0:
                os.kill(os.getpid(), signal.SIGKILL)
            die_in_wait(args.kill_wait)
        if kv.rank() == args.busy_rank and step == args.busy_at:
            end = time.monotonic() + args.busy_s
            while time.monotonic() < end:     # pure Python: holds the GIL
                sum(range(1000))
        if args.step_ms:
            time.sleep(args.step_ms / 1e3)
    if out is None and args.ckpt:     # asked to stop: save, exit 0 (kvcollrun relaunches)
        info = run(lambda: ck.save(args.ckpt, loop.step, incremental=not dumped["full"]))
        if kv.rank() == 0:
            print(f"stopped at step {loop.step} and saved {info.name} on {kv.size()} rank(s)",
                  flush=True)
    if kv.rank() == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if kv.rank() == 0 and args.events:
        with open(args.events, "w") as f:
            json.dump(elastic.events(), f)
    if t_warm is not None and kv.rank() == 0:
        print(f"seconds per step {(time.perf_counter() - t_warm) / (loop.step - 50):.6f}",
              flush=True)
    print(f"rank {kv.rank()} done", flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
