"""The training job of bench/elastic_bench.py: the DeepFM demo (examples/models.py)
through model.fit on SyntheticCTR's global batches (each rank its part of the world it
is in), BSP, kv.callbacks.Checkpoint saving incrementally and restoring at start (so a
relaunch resumes from the latest checkpoint).

Every rank appends one JSON line per step applied to `<--timeline>.rank<R>` (R its rank
at the time): {"t": wall-clock time, "step", "world", "launch" (kvcollrun's launch
number), "rows" (the rows this rank's tables hold)}, flushed at once, so the bench can
time a fault against the first step trained after it, across relaunches, and knows the
rows the lost rank held; from step --dirty-from on (5 steps), rank 2 adds "dirty": its
rows created or changed since its last save (the work a loss of it reverts). At the
end, rank 0 writes --out: the elastic events (kvcoll.elastic.events()), the world
changes the callbacks saw, the last step. SIGUSR1 dumps every thread's Python stack to
stderr (faulthandler), to see where a rank waits.

--prefill N: after the first step, every rank creates N rows of its own (keys far from
the data's ids, N / fields in each field's table, at their initial values), so that a
lost shard holds N rows and more: what a recovery costs against the rows the lost rank
held. The next save writes them.

--no-in-memory: a job without in-memory recovery (the relaunch fallback, for
comparison): after its first step the engine's elastic session is dropped
(engine.elastic = None, the state of a non-elastic or SSP engine), so a lost peer ends
the job with PeerLostError and kvcollrun relaunches it on the hosts left.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from models import build_deepfm  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll import elastic  # noqa: E402
from kvcoll.data import SyntheticCTR  # noqa: E402
from kvcoll.routing import OwnerMap, bucket_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


class Timeline(keras.callbacks.Callback):
    """A line per step applied (flushed at once: the job may be killed)."""

    def __init__(self, path: str, no_in_memory: bool, dirty_from: int, prefill: int = 0):
        super().__init__()
        self.path, self.no_in_memory, self.dirty_from = path, no_in_memory, dirty_from
        self.prefill = prefill
        self.launch = int(os.environ.get("KVCOLLRUN_LAUNCH", "1"))
        self.files = {}

    def on_train_batch_end(self, batch, logs=None):
        eng = kv.keras.engine_of(self.model)
        if self.no_in_memory:
            eng.elastic = None
        if self.prefill and eng.step == 1 and kv.size() == 3:
            prefill(eng.tables, self.prefill, eng.step)
        r = kv.rank()   # (a survivor's rank can change with the world)
        if r not in self.files:
            self.files[r] = open(f"{self.path}.rank{r}", "a", buffering=1, encoding="utf-8")
        rec = {"t": time.time(), "step": eng.step, "world": kv.size(), "launch": self.launch,
               "rows": sum(len(t) for t in eng.tables.values())}
        if r == 2 and 0 < self.dirty_from <= eng.step < self.dirty_from + 5:
            rec["dirty"] = sum(len(t.export(dirty_only=True)["keys"])
                               for t in eng.tables.values())
        self.files[r].write(json.dumps(rec) + "\n")


def prefill(tables: dict, n: int, step: int) -> None:
    """n rows of this rank's own (the even map's buckets) over the tables, in chunks."""
    owners = OwnerMap.even(kv.size()).array
    rng = np.random.default_rng(1000 + kv.rank())
    per = -(-n // len(tables))
    for t in tables.values():
        made = 0
        while made < per:
            keys = rng.integers(1 << 40, 1 << 62, size=1 << 20, dtype=np.int64)
            keys = keys[owners[bucket_of(keys)] == kv.rank()][:per - made]
            t.find_or_create(keys, step=step)
            made += keys.size


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=4096, help="global batch")
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1_000_000, help="ids per field")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--full-every", type=int, default=100)
    p.add_argument("--incremental-every", type=int, default=10)
    p.add_argument("--timeline", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--no-in-memory", action="store_true")
    p.add_argument("--dirty-from", type=int, default=0)
    p.add_argument("--prefill", type=int, default=0)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    kv.init()
    data = SyntheticCTR(num_categorical=args.fields, num_numeric=4, vocab=args.vocab, seed=3)
    source = data.batches(args.batch, kv.rank(), kv.size(), num_steps=args.steps)
    keras.utils.set_random_seed(1)
    model = kv.distribute(build_deepfm(
        args.fields, 4, args.dim,
        lambda f, w: kv.Embedding(f, w, initializer=("normal", 0, 0.05), seed=int(f[1:]))))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                    sparse=kv.optimizers.Adagrad(0.05)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    seen = []
    model.fit(source.fit_batches(), epochs=1, verbose=0, callbacks=[
        kv.callbacks.Checkpoint(args.ckpt, every_n_steps=args.full_every,
                                incremental_every=args.incremental_every, restore=True),
        kv.callbacks.WorldChange(lambda old, new: seen.append([old, new])),
        Timeline(args.timeline, args.no_in_memory, args.dirty_from,
                 args.prefill)])
    eng = kv.keras.engine_of(model)
    print(f"bench rank {kv.rank()} of {kv.size()} done at step {eng.step}", flush=True)
    if kv.rank() == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"events": elastic.events(), "seen": seen, "step": eng.step}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
