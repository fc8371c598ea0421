"""The job of the SIGKILL trials (tests/launch/test_kill_trials.py): BSP training through
kv.Trainer with checkpoints and exports, through kvcoll's public API only (kv.save,
kv.restore, kv.export), killed at a random moment of one phase.

    python kill_driver.py --dir CK --export-dir EX --phase save --victim 1 --seed 7

Every run restores CK's latest checkpoint (with --fresh-ok, none yet is fine), trains,
saves and exports:

    restore  (phase restore: restore twice more, timed, then again, armed)
    train 2 steps (phase train: 12 more, armed over 6 times the second one)
    save     (incremental unless the step is a multiple of 4; phase save: twice a step and
             a save, timed, then a step and a save, armed: saves of the same kind)
    export   (phase export: export, then again with the kill armed)

"Armed" means rank --victim starts a timer that SIGKILLs its own process after a delay
drawn uniformly from [0, the duration of the same phase just measured (the shorter of two
runs)): a random moment inside the phase (or just after it, when this run is quicker). After the armed
phase the victim prints "<phase> done" (the kill came later) and waits to be killed.
--phase none runs the schedule once without a kill; --phase check only restores and
trains 2 steps (nothing written); --steps N trains N steps straight from scratch (a
reference loss curve).

Rank 0 prints "loss <step> <float.hex>" for every step, "restored <step>", "saved
<step> <kind>" (after kv.save returned on every rank); the victim prints "armed <phase>
<delay> <unix time>" just before the armed phase.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time

sys.modules.setdefault("matplotlib", None)  # Keras imports it for plotting: not needed here
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import kvcoll as kv  # noqa: E402

B = 256         # global batch
BAG = 64        # ids per sample in the multi-hot feature, out of VOCAB: the table fills
VOCAB = 200_000  # up to 200,000 rows in the first ~30 steps (saves of ~0.1 s, exports of ~1 s)


def build():
    import keras

    keras.utils.set_random_seed(3)
    user = keras.Input(shape=(), dtype="int64", name="user")
    bag = keras.Input(shape=(BAG,), dtype="int64", name="bag")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    parts = [kv.Embedding("user", 4, initializer=("normal", 0, 0.1), seed=1)(user),
             kv.Embedding("bag", 4, combiner="mean", initializer=("uniform", -0.1, 0.1),
                          seed=2)(bag), x]
    z = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()(parts))
    model = kv.Model({"user": user, "bag": bag, "x": x}, keras.layers.Dense(1)(z))
    opt = kv.DistributedOptimizer(keras.optimizers.Adam(0.01), sparse=kv.optimizers.Adagrad(0.2))
    return kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt)


def batch(step: int, rank: int, world: int):
    """This rank's slice of global batch `step` (the same global batch on any world)."""
    g = np.random.default_rng([13, step])
    data = {"user": g.integers(0, 10_000, B), "bag": g.integers(0, VOCAB, (B, BAG)),
            "x": g.normal(size=(B, 3)).astype(np.float32)}
    label = (g.random(B) < 0.4).astype(np.float32)
    lo, hi = B * rank // world, B * (rank + 1) // world
    return {k: v[lo:hi] for k, v in data.items()}, label[lo:hi]


class Run:
    def __init__(self, args):
        self.args = args
        self.tr = build()
        kv.broadcast_variables(self.tr.model.variables, root_rank=0)
        self.rank, self.world = kv.rank(), kv.size()
        self.rng = random.Random(args.seed)
        self.victim = self.rank == args.victim

    def say(self, text: str, everyone: bool = False) -> None:
        if everyone or self.rank == 0:
            print(text, flush=True)

    def arm(self, phase: str, seconds: float) -> None:
        """Rank --victim: SIGKILL this process after U(0, seconds)."""
        delay = self.rng.uniform(0.0, max(seconds, 1e-3))
        if self.victim:
            print(f"armed {phase} {delay:.4f} {time.time():.4f}", flush=True)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def done(self, phase: str) -> None:
        """After an armed phase: say it finished and wait for the kill (a few seconds)."""
        if self.victim:
            print(f"{phase} done", flush=True)
        time.sleep(30)
        raise SystemExit(f"{phase}: the kill never came")

    def step(self) -> float:
        s = self.tr.step + 1
        x, y = batch(s, self.rank, self.world)
        loss = self.tr.train_step(x, y)
        self.say(f"loss {s} {float(loss).hex()}")
        return loss

    def timed(self, fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def restore(self) -> None:
        d = self.args.dir
        try:
            kv.restore(d, self.tr)
        except kv.CheckpointError as exc:
            if not self.args.fresh_ok:
                raise
            self.say(f"restored 0 (nothing yet: {exc})")
            return
        self.say(f"restored {self.tr.step}")
        if self.args.phase == "restore":  # timed twice more (files cached), then armed
            took = min(self.timed(lambda: kv.restore(d, self.tr)) for _ in range(2))
            self.arm("restore", took)
            kv.restore(d, self.tr)
            self.done("restore")

    def save(self, kind: str) -> float:
        t0 = time.perf_counter()
        info = kv.save(self.args.dir, self.tr, incremental=kind == "delta")
        self.say(f"saved {info.step} {info.kind}")
        return time.perf_counter() - t0

    def main(self) -> None:
        a = self.args
        if a.steps:  # reference: straight training, no checkpoint
            while self.tr.step < a.steps:
                self.step()
            return
        self.restore()
        if a.phase == "check":  # restore, then 2 steps: nothing saved or exported
            self.step()
            self.step()
            return
        self.step()                       # the first step traces the compiled step
        took = self.timed(self.step)
        if a.phase == "train":
            self.arm("train", 6 * took)
            for _ in range(12):
                self.step()
            self.done("train")
        kind = "full" if self.tr.step % 4 == 0 else "delta"
        self.save(kind)
        if a.phase == "save":  # two more saves of the same kind timed, the fourth armed
            took = []
            for _ in range(2):
                self.step()
                took.append(self.save(kind))
            self.step()
            self.arm("save", min(took))
            self.save(kind)
            self.done("save")
        took = self.timed(lambda: kv.export(a.export_dir, self.tr))
        if a.phase == "export":
            self.arm("export", took)
            kv.export(a.export_dir, self.tr)
            self.done("export")
        self.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir")
    p.add_argument("--export-dir")
    p.add_argument("--phase", choices=("none", "restore", "train", "save", "export", "check"),
                   default="none")
    p.add_argument("--victim", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="reference run: train N steps")
    p.add_argument("--fresh-ok", action="store_true",
                   help="start from step 0 when --dir holds no checkpoint yet")
    args = p.parse_args(argv)
    kv.init(argv=[])
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    Run(args).main()
    kv.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
