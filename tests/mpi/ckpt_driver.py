"""Checkpoint test driver: trains, saves, restores and dumps state under mpirun.

Not a test module (tests/launch/test_checkpoint_reshard.py runs it, and
tests/unit/test_checkpoint.py imports its model and helpers).

    python ckpt_driver.py train  --steps 10 --dir D --full-at 4 --incremental-at 5,6,7
                                 [--full-dir D2 --full-dir-at 7] [--dump-at 7 --dump X.npz]
                                 [--losses L.json] [--kill-rank 1 --kill-at 4 --kill-after-files 1]
    python ckpt_driver.py resume --dir D --steps 10 --dump X.npz --losses L.json
                                 [--also-dir D2 --also-dump Y.npz]

Every rank takes its slice of global batch `step`, which depends on the step alone,
so runs at different world sizes see the same global batches.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

from toy import B, build, global_batch, take  # noqa: E402,F401


def make_trainer(comm=None, lr=0.02):
    model = build()
    opt = kv.DistributedOptimizer(keras.optimizers.Adam(lr), sparse=kv.optimizers.Adagrad(0.2))
    return kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt, comm=comm)


def my_slice(comm):
    return B * comm.rank // comm.size, B * (comm.rank + 1) // comm.size


def train_step(trainer, step):
    """Global step `step` (1-based) on this rank's slice."""
    b = take(global_batch(step), *my_slice(trainer.comm))
    label = b.pop("label")
    return trainer.train_step(b, label)


def state(trainer) -> dict:
    """Every row (sorted by key), slot and header of every table over all ranks, the
    dense and optimizer variables and the step: the same on every rank."""
    out = {"step": np.array(trainer.step)}
    for name, t in trainer.tables.items():
        e = t.export()
        cols = {}
        for k in ("keys", "values", "slots", "last_step", "counts"):
            v = e[k].astype(np.int64) if e[k].dtype == np.uint32 else e[k]
            cols[k], _ = trainer.comm.allgatherv(v, op="test:state")
        order = np.argsort(cols["keys"])
        for k, v in cols.items():
            out[f"{name}/{k}"] = v[order]
    for i, v in enumerate(trainer.model.variables):
        out[f"model/{i}"] = v.numpy()
    for i, v in enumerate(trainer.opt.variables):
        out[f"opt/{i}"] = v.numpy()
    return out


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
m = tf.saved_model.load(sys.argv[1])
feeds = {k: tf.constant(v) for k, v in np.load(sys.argv[2]).items()}
out = m.signatures["serving_default"](**feeds)["prediction"].numpy()
np.save(sys.argv[3], out)
print(json.dumps(sorted(k for k in sys.modules if k.split(".")[0] in
                        ("kvcoll", "mpi4py", "keras"))))
"""


def serving_features(step: int = 1) -> dict:
    """Global batch `step` without its label, with ids never seen (and the reserved
    extremes of int64) among them, and empty multi-hot rows."""
    b = take(global_batch(step), 0, B)
    b.pop("label")
    b["user"] = np.concatenate([b["user"][:B - 3], [10**12, -(2**63), 2**63 - 1]])
    b["item"][:2] = [777777, -5]
    return b


def serve_with_tensorflow_alone(saved_model: str, features: dict, workdir: str):
    """Run a SavedModel on `features` in a fresh process that imports TensorFlow only:
    (its predictions, the kvcoll/mpi4py/keras modules that process imported)."""
    import subprocess

    feeds = {}
    for k, v in features.items():
        if isinstance(v, tuple):
            feeds[k] = v[0].astype(np.int64)
            feeds[k + "_row_splits"] = np.asarray(v[1], np.int64)
        else:
            feeds[k] = v
    feeds_path, out_path = os.path.join(workdir, "feeds.npz"), os.path.join(workdir, "out.npy")
    np.savez(feeds_path, **feeds)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-c", SERVE, saved_model, feeds_path, out_path],
                          capture_output=True, text=True, cwd=workdir, timeout=180,
                          env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out_path), json.loads(proc.stdout.strip().splitlines()[-1])


def _ints(text):
    return [int(s) for s in text.split(",") if s] if text else []


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("train", "resume"))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--full-at", default="")
    p.add_argument("--incremental-at", default="")
    p.add_argument("--full-dir")
    p.add_argument("--full-dir-at", type=int)
    p.add_argument("--dump-at", type=int)
    p.add_argument("--dump")
    p.add_argument("--losses")
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-after-files", type=int, default=1)
    p.add_argument("--also-dir")
    p.add_argument("--also-dump")
    args = p.parse_args(argv)
    kv.init(argv=[])
    trainer = make_trainer()
    kv.broadcast_variables(trainer.model.variables, root_rank=0)
    comm = trainer.comm
    losses = {}
    if args.mode == "resume":
        if args.also_dir:  # a second checkpoint first, dumped, then the main one
            kv.restore(args.also_dir, trainer)
            if comm.rank == 0:
                np.savez(args.also_dump, **state(trainer))
            else:
                state(trainer)
        info = kv.restore(args.dir, trainer)
        snap = state(trainer)
        if comm.rank == 0:
            np.savez(args.dump, **snap)
            print(f"restored {info.name} (chain {list(info.chain)}) at step {info.step} on "
                  f"{comm.size} rank(s)", flush=True)
    full_at, inc_at = _ints(args.full_at), _ints(args.incremental_at)
    while trainer.step < args.steps:
        step = trainer.step + 1
        losses[step] = train_step(trainer, step)
        assert trainer.step == step
        if args.kill_at == step:
            import kvcoll.checkpoint as ck

            real, written = ck._write_shard, []

            def dying(path, *rest):
                if comm.rank == args.kill_rank and len(written) >= args.kill_after_files:
                    os.kill(os.getpid(), signal.SIGKILL)
                written.append(path)
                return real(path, *rest)
            ck._write_shard = dying
            kv.save(args.dir, trainer)
            raise AssertionError("the save should have been killed")
        if step in full_at:
            kv.save(args.dir, trainer)
        if step in inc_at:
            info = kv.save(args.dir, trainer, incremental=True)
            assert info.kind == "delta", info
        if args.full_dir and step == args.full_dir_at:
            kv.save(args.full_dir, trainer)
        if step == args.dump_at:
            snap = state(trainer)
            if comm.rank == 0:
                np.savez(args.dump, **snap)
    if comm.rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)
    trainer.close()
    kv.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
