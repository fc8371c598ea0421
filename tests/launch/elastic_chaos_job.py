"""The job of tests/launch/test_elastic_chaos.py: the DeepFM demo (examples/models.py)
trained with model.fit on SyntheticCTR's global batches (the global batch of step t
never depends on the world size: each rank takes its part of the world it is in), BSP,
kv.callbacks.Checkpoint saving a delta every --incremental-every steps and a full
checkpoint every --full-every, restoring at start (a relaunch resumes from the latest
checkpoint) and saving at the end.

Whichever rank is rank 0 prints `chaos step S world W launch L` after every step it
applied (L: kvcollrun's launch number), so the test times each event from the fault to
the first step trained after it, and sees the world shrink and grow. SIGUSR1 dumps
every thread's Python stack to stderr (faulthandler): where a rank waits.

--eval DIR [DIR ...]: no training; one process builds the same model, restores each
directory's latest checkpoint (kv.restore, resharded onto one rank) and prints one line
`chaos auc DIR STEP AUC` per directory: the AUC of its predictions on --eval-samples
held-out samples (SyntheticCTR's "eval" stream, never trained on; the same samples for
every directory).
"""

import argparse
import faulthandler
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import keras
import numpy as np
import tensorflow as tf
from models import build_deepfm

import kvcoll as kv
from kvcoll.data import SyntheticCTR
from kvcoll.data.synthetic import auc

NUMERIC = 4


class Steps(keras.callbacks.Callback):
    """Rank 0 (whichever rank it is now) says every step it applied."""

    def __init__(self):
        super().__init__()
        self.launch = os.environ.get("KVCOLLRUN_LAUNCH", "1")

    def on_train_batch_end(self, batch, logs=None):
        if kv.rank() == 0:
            step = kv.keras.engine_of(self.model).step
            print(f"chaos step {step} world {kv.size()} launch {self.launch}", flush=True)


def data_of(args) -> SyntheticCTR:
    return SyntheticCTR(num_categorical=args.fields, num_numeric=NUMERIC, vocab=args.vocab,
                        seed=args.seed)


def model_of(args):
    keras.utils.set_random_seed(1)
    model = kv.distribute(build_deepfm(
        args.fields, NUMERIC, args.dim,
        lambda f, w: kv.Embedding(f, w, initializer=("normal", 0, 0.05), seed=int(f[1:])),
        hidden=tuple(args.hidden)))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                    sparse=kv.optimizers.Adagrad(0.05)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def train(args) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # (where a rank waits)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    kv.init()
    source = data_of(args).batches(args.batch, kv.rank(), kv.size(), num_steps=args.steps)
    model = model_of(args)
    model.fit(source.fit_batches(), epochs=1, verbose=0, callbacks=[
        kv.callbacks.Checkpoint(args.ckpt, every_n_steps=args.full_every,
                                incremental_every=args.incremental_every, restore=True,
                                max_to_keep=args.keep),
        Steps()])
    step = kv.keras.engine_of(model).step
    print(f"chaos rank {kv.rank()} of {kv.size()} done at step {step}", flush=True)
    return 0


def evaluate(args) -> int:
    kv.init()
    data = data_of(args)
    ev = data.eval_set(args.eval_samples)
    x = {f"C{f + 1}": np.ascontiguousarray(ev["categorical"][:, f]) for f in range(args.fields)}
    x["numeric"] = ev["numeric"]
    for directory in args.eval:
        model = model_of(args)
        info = kv.restore(directory, model)
        scores = model.predict(x, batch_size=8192, verbose=0).ravel()
        print(f"chaos auc {directory} {info.step} {auc(ev['label'], scores):.6f}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=4096, help="global batch")
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 64])
    p.add_argument("--vocab", type=int, default=100_000, help="ids per field")
    p.add_argument("--seed", type=int, default=30, help="the data set's")
    p.add_argument("--ckpt")
    p.add_argument("--full-every", type=int, default=100)
    p.add_argument("--incremental-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=4, help="checkpoints kept (max_to_keep)")
    p.add_argument("--eval", nargs="+", help="evaluate these checkpoint directories")
    p.add_argument("--eval-samples", type=int, default=200_000)
    args = p.parse_args()
    if args.eval:
        return evaluate(args)
    if not args.ckpt:
        p.error("--ckpt is needed to train")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
