"""kvcoll inside a Horovod job: one MPI world, kvcoll's tables, and (optionally)
Horovod's allreduce for the dense gradients.

Horovod is never imported unless the user's script has imported it (or asks for its
allreduce): kvcoll without Horovod is unchanged.

- One world. `kv.init()` and `hvd.init()` may come in either order: whichever comes
  first initialises MPI (kvcoll through mpi4py, with MPI_THREAD_MULTIPLE; Horovod with
  MPI_THREAD_MULTIPLE unless HOROVOD_MPI_THREADS_DISABLE is set) and the other uses
  it. kvcoll keeps its own duplicate of COMM_WORLD; Horovod keeps its own. Horovod's
  background thread calls MPI while kvcoll's collectives run on the training thread,
  so both need MPI_THREAD_MULTIPLE: kv.init refuses otherwise, naming the fix, before
  its first collective (runtime._horovod_threads; `check` does again before training,
  for a Horovod initialised after kv.init), and `check` refuses a Horovod world that is
  not kvcoll's (hvd.init(comm=...) on a part of it).
- Dense gradients. `kv.DistributedOptimizer(opt, dense_backend="horovod")` (the
  default when `opt` is an `hvd.DistributedOptimizer`) sends the step's flat dense
  gradient through `hvd.allreduce(op=hvd.Sum)` instead of kvcoll's MPI allreduce;
  every rank's gradient is already weighted by its share of the global batch, so the
  sum is the global batch's gradient either way. The embedding rows go through
  kvcoll's all-to-all as always, and the step's loss, failure flags and metric states
  through kvcoll's own (small) allreduce. Horovod's allreduce has Horovod's own
  deadline (its stall check), not kvcoll's.
- Horovod's background thread. Every cycle (HOROVOD_CYCLE_TIME, 1 ms) it runs a
  blocking MPI collective with every rank's background thread (the response cache's
  bit vector, even when idle), and Open MPI spins while it waits: a rank whose peer's
  thread is descheduled burns a core the training step needs. On 2 cores with 2 ranks
  that cost Horovod's path 0.61-0.84x of kvcoll's own allreduce on a quiet machine,
  0.34x on a busy one. So `check` (before training, with Horovod initialised) has Open
  MPI yield the core when a wait makes no progress (what OMPI_MCA_mpi_yield_when_idle=1
  does at start-up; set that variable to 0 to keep spinning): 0.94-1.0x. The flat
  gradient itself goes to Horovod as one tensor of a fixed name, so Horovod's response
  cache and no fusion apply (HOROVOD_FUSION_THRESHOLD and HOROVOD_CACHE_CAPACITY change
  nothing measurable; a longer cycle only adds latency).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ..errors import CommError, InvalidArgumentError
from ..runtime import BESIDE_HOROVOD

__all__ = ["BACKENDS", "imported", "initialized", "is_horovod_optimizer", "check",
           "allreduce_sum", "yield_when_idle"]

BACKENDS = ("kvcoll", "horovod")
_NAME = "kvcoll.dense_gradient"


def imported() -> bool:
    """Whether the program has imported Horovod's TensorFlow layer."""
    return "horovod.tensorflow" in sys.modules


def _hvd():
    import horovod.tensorflow as hvd

    return hvd


def initialized() -> bool:
    return imported() and bool(_hvd().is_initialized())


def is_horovod_optimizer(opt) -> bool:
    """Whether `opt` is an hvd.DistributedOptimizer (a class Horovod made from a Keras
    optimizer's)."""
    return any(c.__module__.startswith("horovod.") for c in type(opt).__mro__)


def check(comm, backend: str, optimizer=None) -> None:
    """Before training: with Horovod initialised, MPI must run with
    MPI_THREAD_MULTIPLE and Horovod's world must be kvcoll's; the "horovod" backend
    needs hvd.init(). Raises CommError or InvalidArgumentError naming the fix."""
    if backend == "horovod" and not initialized():
        raise InvalidArgumentError(
            "dense_backend='horovod' sends the dense gradients through Horovod's allreduce: "
            "call hvd.init() (import horovod.tensorflow.keras as hvd) before training, or "
            "use dense_backend='kvcoll'")
    if not initialized():
        return
    hvd = _hvd()
    comm.require_threads(BESIDE_HOROVOD)
    if (hvd.size(), hvd.rank()) != (comm.size, comm.rank):
        raise CommError(
            f"Horovod's world (rank {hvd.rank()} of {hvd.size()}) is not kvcoll's (rank "
            f"{comm.rank} of {comm.size}): call hvd.init() without a communicator or process "
            "sets, so both share MPI_COMM_WORLD")
    if backend == "horovod" and optimizer is not None and \
            getattr(optimizer, "_agg_helper", None) is not None:
        raise InvalidArgumentError(
            "hvd.DistributedOptimizer(backward_passes_per_step > 1) accumulates gradients "
            "over steps, which kvcoll's step (rows applied every step) cannot follow; use "
            "backward_passes_per_step=1")
    yield_when_idle()


# The Open MPI setting that makes a wait without progress yield the core; set by the
# user (to anything), it is theirs, and kvcoll leaves it alone.
_YIELD_VAR = "OMPI_MCA_mpi_yield_when_idle"
_yielding: list = []   # [True] once switched on in this process


def yield_when_idle() -> bool:
    """Have Open MPI's progress engine yield the core when a wait makes no progress
    (sched_yield), in this process, from now on: Horovod's background thread then stops
    spinning in its per-cycle collective while the training step needs the core. The
    switch is Open MPI's own (opal_progress_set_yield_when_idle, the function its
    mpi_yield_when_idle setting calls at start-up), found in the libopen-pal this process
    loaded; under another MPI, or when the user set OMPI_MCA_mpi_yield_when_idle, it does
    nothing. Returns whether it switched it on (now or before)."""
    if _yielding:
        return True
    if os.environ.get(_YIELD_VAR) is not None:
        return False
    switch = _opal_function("opal_progress_set_yield_when_idle")
    if switch is None:
        return False
    import ctypes

    switch.argtypes, switch.restype = [ctypes.c_bool], None
    switch(True)
    _yielding.append(True)
    return True


def _opal_function(name: str):
    """`name` from the Open MPI support library (libopen-pal) this process has mapped, or
    None (another MPI, or not Linux)."""
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "libopen-pal" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
    return None


def allreduce_sum(flat: np.ndarray) -> np.ndarray:
    """The elementwise sum over every rank of a float32 vector, by Horovod's allreduce
    (a collective: every rank calls it once per step, in the same order)."""
    import tensorflow as tf

    hvd = _hvd()
    out = hvd.allreduce(tf.constant(flat, tf.float32), op=hvd.Sum, name=_NAME)
    return out.numpy()
