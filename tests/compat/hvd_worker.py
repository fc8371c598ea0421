"""kvcoll inside a Horovod job, one case per run (tests/compat/test_horovod.py starts it
on 2 ranks under horovodrun or mpirun):

    kv-first / hvd-first   kv.init() and hvd.init() in that order share one world: the
                           same ranks, kvcoll's communicator a duplicate of COMM_WORLD,
                           MPI_THREAD_MULTIPLE, both allreduces work, and a fit whose
                           dense gradients ride Horovod's allreduce; the fit switched
                           Open MPI to yield when idle (unless OMPI_MCA_mpi_yield_when_idle
                           is set: then it is left as the user set it)
    threads-disabled       Horovod initialised MPI without thread support
                           (HOROVOD_MPI_THREADS_DISABLE=1): kv.init refuses with the fix
    broadcast              hvd.callbacks.BroadcastGlobalVariablesCallback gives every rank
                           rank 0's dense weights and leaves kvcoll's tables as they were

Prints "CASE ok" on success (rank 0).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi"))

import numpy as np  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

from model import batches, build, keras  # noqa: E402

CASE = sys.argv[1]


def compile_hvd(model):
    opt = kv.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.Adam(0.02)),
                                  sparse=kv.optimizers.Adagrad(0.2))
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def one_world():
    from mpi4py import MPI

    comm = kv.runtime.comm()
    assert (hvd.size(), hvd.rank()) == (kv.size(), kv.rank()) == (MPI.COMM_WORLD.Get_size(),
                                                                   MPI.COMM_WORLD.Get_rank())
    assert MPI.Comm.Compare(comm._comm, MPI.COMM_WORLD) == MPI.CONGRUENT  # a duplicate
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE and hvd.mpi_threads_supported()
    assert float(hvd.allreduce(np.float32(kv.rank() + 1), op=hvd.Sum)) == \
        kv.allreduce(float(kv.rank() + 1), op="sum") == kv.size() * (kv.size() + 1) / 2
    assert not yielding() or "OMPI_MCA_mpi_yield_when_idle" in os.environ
    model = compile_hvd(build())
    hist = model.fit(batches(0, 3, kv.rank(), kv.size()), epochs=1, steps_per_epoch=3, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    setting = os.environ.get("OMPI_MCA_mpi_yield_when_idle")
    assert yielding() == (setting != "0"), (yielding(), setting)
    if kv.rank() == 0:
        print(f"yielding {yielding()} (OMPI_MCA_mpi_yield_when_idle={setting})", flush=True)


def yielding() -> bool:
    """Open MPI's own flag: does its progress engine yield the core when idle?"""
    import ctypes

    from kvcoll.keras import _horovod

    with open("/proc/self/maps") as f:
        path = next(line.split()[-1] for line in f if "libopen-pal" in line)
    assert _horovod._opal_function("opal_progress_set_yield_when_idle") is not None
    return ctypes.c_bool.in_dll(ctypes.CDLL(path), "opal_progress_yield_when_idle").value


def threads_disabled():
    """kv.init refuses before its first collective: beside Horovod's background thread,
    one on this thread could crash the process (it did, in Open MPI's NBC_Progress, when
    the refusal came at fit). No MPI call here either: a rank that refused first and
    exited shuts Horovod down on every rank, whose Horovod thread then finalizes MPI
    (MPI_Query_thread here aborted the slower rank once)."""
    assert not hvd.mpi_threads_supported()
    try:
        kv.init(argv=[])
    except kv.CommError as exc:
        text = str(exc)
        assert "MPI_THREAD_MULTIPLE" in text and "HOROVOD_MPI_THREADS_DISABLE" in text, text
        assert not kv.is_initialized()
    else:
        raise AssertionError("kv.init ran next to Horovod without MPI thread support")
    if hvd.rank() == 0:
        print("threads-disabled ok", flush=True)
    sys.exit(0)


def broadcast():
    model = compile_hvd(build())
    rank, world = kv.rank(), kv.size()
    seen = {}

    class Perturb(keras.callbacks.Callback):
        """Before the broadcast (batch 0): rank 1's dense weights drift; note the tables."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                if rank == 1:
                    for w in self.model.trainable_weights:
                        w.assign(w + 1.0)
                seen["tables"] = {n: t.export() for n, t in engine_of(self.model).tables.items()}
                seen["mine"] = np.concatenate([w.numpy().ravel() for w in self.model.weights])

    class Check(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch != 0:
                return
            flat = np.concatenate([w.numpy().ravel() for w in self.model.weights])
            every = kv.allgather(flat[None])
            root = kv.broadcast(seen["mine"], root_rank=0)
            for r in range(world):
                np.testing.assert_array_equal(every[r], root)   # rank 0's, everywhere
            if rank == 1 and world > 1:
                assert not np.array_equal(seen["mine"], flat)   # rank 1's were replaced
            for n, t in engine_of(self.model).tables.items():
                now, before = t.export(), seen["tables"][n]
                for k in ("keys", "values", "slots", "last_step", "counts"):
                    np.testing.assert_array_equal(now[k], before[k], err_msg=f"{n}/{k}")
            seen["checked"] = True

    model.fit(batches(0, 3, rank, world), epochs=1, steps_per_epoch=3, verbose=0,
              callbacks=[Perturb(), hvd.callbacks.BroadcastGlobalVariablesCallback(0), Check()])
    assert seen.get("checked")


if CASE == "kv-first":
    kv.init(argv=[])
    hvd.init()
    one_world()
elif CASE == "threads-disabled":
    hvd.init()
    threads_disabled()
elif CASE in ("hvd-first", "broadcast"):
    hvd.init()
    kv.init(argv=[])
    {"hvd-first": one_world, "broadcast": broadcast}[CASE]()
else:
    raise SystemExit(f"unknown case {CASE!r}")
if kv.rank() == 0:
    print(f"{CASE} ok", flush=True)
kv.shutdown()
