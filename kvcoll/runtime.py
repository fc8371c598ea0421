"""Process-wide state: the run's Config and kvcoll's communicator.

`init()` reads the configuration once (code > --flags > KVCOLL_* > defaults), brings
MPI up with thread support, duplicates COMM_WORLD and makes an uncaught exception on
any rank end the whole job.

Shutting down inside a Horovod job. Horovod's shutdown is global: when one rank calls
it (hvd.shutdown(), which Horovod registers with atexit), the background threads of
every rank stop together, and where Horovod initialised MPI (hvd.init() before
kv.init()) each rank's background thread then calls MPI_Finalize, whatever that rank's
main thread is doing. A rank still inside kvcoll's last collective (polling its request
with MPI_Test, freeing its communicator) a few milliseconds after a faster peer left
crashes: "An error occurred in MPI_Test on a NULL communicator", exit code 14. So
`shutdown()` ends with a barrier through Horovod itself, after kvcoll's last MPI call:
no rank can leave (and start Horovod's shutdown) before every rank is done with
kvcoll's MPI, and the main thread then waits on a Horovod op that Horovod completes
before it processes any shutdown. At exit, kvcoll's handler runs `shutdown()` while
Horovod is still running (it does in that order: atexit runs the later registration,
kvcoll's, first).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import numpy as np

from . import ids
from ._c import lib
from .comm import Comm, announce, install_abort_hook, skip_finalize, threads_refused
from .config import Config
from .errors import CommError, CommTimeoutError, InvalidArgumentError, KvcollError

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "config", "comm",
           "is_initialized", "allreduce", "allgather", "broadcast", "preempted",
           "core_share", "share_cores_with_tensorflow"]

_state: dict = {}


def init(argv: list[str] | None = None, **settings) -> Config:
    """Start kvcoll: MPI up (MPI_THREAD_MULTIPLE, or the MPI a Horovod job started),
    kvcoll's private communicator, every rank's host learnt, the run's settings resolved.
    A collective: every rank calls it once, before anything else of kvcoll.

    argv: the command line to read kvcoll's flags from (default sys.argv[1:], so
    `--step-mode ssp --staleness 2` work; other flags are left alone). settings: any
    field of kvcoll.Config (step_mode=, staleness=, comm_timeout=, io_timeout=,
    startup_timeout=, id_hash=), which win over flags and KVCOLL_* variables. Returns
    the run's Config; calling init again returns the first one.

    Raises InvalidArgumentError for an unknown setting, flag value or KVCOLL_*
    variable; CommTimeoutError when a rank does not start within the start-up deadline
    (KVCOLL_STARTUP_TIMEOUT), naming it.
    """
    if _state:
        return _state["config"]
    cfg = Config.resolve(sys.argv[1:] if argv is None else argv, **settings)
    ids.configure(cfg.id_hash)
    lib.kv_set_huge_advice(cfg.huge_pages == "on")
    if cfg.elastic_min_np:  # (kvcoll.elastic) MPI_Finalize may hang after a lost peer
        skip_finalize()
    _horovod_threads()
    try:
        comm = Comm(timeout=cfg.comm_timeout, timeouts=cfg.timeouts,
                    elastic=cfg.elastic_min_np > 0, topology=cfg.exchange_topology)
    except CommError as exc:     # a peer lost or not started before anything began:
        if cfg.elastic_min_np:   # the elastic launcher starts the job again
            announce({"event": "start_failed", "error": str(exc)})
        raise
    _state.update(config=cfg)
    replace_comm(comm)
    share_cores_with_tensorflow()
    atexit.register(_at_exit)
    if cfg.elastic_min_np:  # the launcher learns which ranks started and which ended
        _stop_on_sigusr2()  # first: a stop may follow the announcement at once
        announce({"event": "start", "rank": comm.rank})
    return cfg


def core_share() -> int:
    """This rank's cores: the cores its CPU affinity allows, divided by the ranks on its
    host (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local = local_size() if is_initialized() else 1
    return max(1, cores // max(1, local))


def share_cores_with_tensorflow() -> str:
    """Ranks that share a host share its cores (kv.init does this): TensorFlow, which
    sizes its thread pools to every core of the host in each rank, gets this rank's
    share (core_share()) for its intra-op pool and 1 thread for its inter-op pool,
    unless the program chose (TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS, or
    tf.config.threading before kv.init) or the rank is alone on its host. TensorFlow
    reads them when its runtime starts, at its first op: a program whose TensorFlow
    already ran keeps what it had. Returns what it did, for the tests."""
    if local_size() < 2:
        return "alone on its host"
    chosen = [v for v in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
              if v in os.environ]
    if chosen:
        return f"chosen: {', '.join(chosen)}"
    share, tf = core_share(), sys.modules.get("tensorflow")
    if tf is None or not hasattr(tf, "config"):
        os.environ["TF_NUM_INTRAOP_THREADS"] = str(share)
        os.environ["TF_NUM_INTEROP_THREADS"] = "1"
        return f"{share} intra-op, 1 inter-op (environment)"
    threading_ = tf.config.threading
    if threading_.get_intra_op_parallelism_threads() or \
            threading_.get_inter_op_parallelism_threads():
        return "chosen"
    try:
        threading_.set_intra_op_parallelism_threads(share)
        threading_.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # TensorFlow's runtime has started: its pools are made
        return "TensorFlow already running"
    return f"{share} intra-op, 1 inter-op"


def _stop_on_sigusr2() -> None:
    """Elastic runs: kvcollrun asks a job to stop after a step and save (to grow it, as a
    preemption does) with SIGUSR2; outside model.fit (which stops every rank after the
    same step) it is noted (preempted()), never fatal."""
    import signal

    try:
        signal.signal(signal.SIGUSR2, lambda *_: note_preempted())
    except ValueError:  # not the main thread: the default stays
        pass


def replace_comm(comm: Comm) -> None:
    """Make `comm` kvcoll's communicator (kv.init; kvcoll.elastic after a lost rank):
    kv.rank(), kv.size() and local_rank() answer for it, and an uncaught exception
    aborts it."""
    install_abort_hook(comm)
    hosts = comm.hosts  # learnt with the communicator (every rank's pid and host)
    mine = [r for r, h in enumerate(hosts) if h == hosts[comm.rank]]
    _state.update(comm=comm, local=(mine.index(comm.rank), len(mine)))


def _at_exit() -> None:
    """Stop SSP/ASP service threads before MPI_Finalize (which mpi4py runs at exit,
    after this: atexit runs in reverse order of registration). An elastic run tells its
    launcher that this rank ended normally. Inside a Horovod job whose Horovod still
    runs (hvd.init() came first, so Horovod's own atexit shutdown comes after this),
    shut kvcoll down as well, ending with Horovod's barrier: see the module's
    docstring."""
    from .exchange.ssp import close_all

    close_all()
    if _state and _state["config"].elastic_min_np:
        announce({"event": "exit", "rank": _state["comm"].rank, "preempted": preempted()})
    if _state and _horovod_world(_state["comm"]):
        shutdown()


def is_initialized() -> bool:
    """Whether kv.init() has run (and kv.shutdown() has not) in this process. Raises
    nothing."""
    return bool(_state)


def _need(name: str):
    if not _state:
        raise KvcollError(f"kvcoll.{name}() needs kvcoll.init() first")
    return _state


def config() -> Config:
    return _need("config")["config"]


def comm() -> Comm:
    return _need("comm")["comm"]


def rank() -> int:
    """This process's rank in kvcoll's communicator (0 .. size() - 1). Raises
    KvcollError before kv.init()."""
    return _need("rank")["comm"].rank


def size() -> int:
    """The number of ranks in kvcoll's communicator. Raises KvcollError before
    kv.init()."""
    return _need("size")["comm"].size


_preempted = threading.Event()


def preempted() -> bool:
    """Whether this process got SIGTERM (or kvcollrun's SIGUSR2) while model.fit ran:
    fit then stops every rank after the same step and returns with
    `history.preempted = True`; a loop of your own may check this. Raises nothing."""
    return _preempted.is_set()


def note_preempted() -> None:
    _preempted.set()


def local_rank() -> int:
    """This process's index among the ranks on its host (0 .. local_size() - 1), by
    host name. Raises KvcollError before kv.init()."""
    return _need("local_rank")["local"][0]


def local_size() -> int:
    """How many ranks run on this process's host (by host name). Raises KvcollError
    before kv.init()."""
    return _need("local_size")["local"][1]


def _as_numpy(value):
    """(numpy array of value, a function turning a numpy result back into value's kind)."""
    if hasattr(value, "numpy") and hasattr(value, "dtype") and hasattr(value, "shape"):
        import tensorflow as tf  # only reached with a TensorFlow value

        return np.asarray(value.numpy()), lambda a: tf.convert_to_tensor(a, dtype=value.dtype)
    if isinstance(value, np.ndarray):
        return value, lambda a: a
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise InvalidArgumentError(
            f"collectives take numbers (numpy arrays, TensorFlow tensors or scalars), got "
            f"{type(value).__name__} of {arr.dtype}")
    return arr, (lambda a: a.item()) if arr.ndim == 0 else (lambda a: a)


def allreduce(value, op: str = "mean"):
    """value combined over every rank ("mean" as Horovod's default, "sum", "max",
    "min"); numpy arrays, TensorFlow tensors or Python numbers, returned as given. A
    collective: every rank calls it with the same shape.

        rank 0: allreduce(np.array([1., 2.]))   rank 1: allreduce(np.array([3., 4.]))
        -> both: array([2., 3.])

    value: the local value; op: "mean", "sum", "max" or "min". Raises
    InvalidArgumentError for another op, KvcollError before kv.init(),
    CommTimeoutError when a rank does not take part within the step deadline.
    """
    if op not in ("mean", "sum", "max", "min"):
        raise InvalidArgumentError(f"allreduce: op must be 'mean', 'sum', 'max' or 'min', got {op!r}")
    c = _need("allreduce")["comm"]
    arr, back = _as_numpy(value)
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    out = c.allreduce(np.ascontiguousarray(arr), op="kv.allreduce",
                      mpi_op="sum" if op == "mean" else op)
    if op == "mean":
        out = out / c.size if out.dtype.kind == "f" else out.astype(np.float64) / c.size
    return back(out)


def allgather(value):
    """Every rank's value concatenated along the first axis, in rank order (the other
    axes must agree; first dimensions may differ). A collective.

        rank 0: allgather(np.array([1]))   rank 1: allgather(np.array([2, 3]))
        -> both: array([1, 2, 3])

    value: a numpy array, a TensorFlow tensor or a number (a scalar counts as one
    element). Raises KvcollError before kv.init(), CommTimeoutError when a rank does
    not take part within the step deadline.
    """
    c = _need("allgather")["comm"]
    arr, back = _as_numpy(value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    out, _ = c.allgatherv(np.ascontiguousarray(arr), op="kv.allgather")
    return back(out) if not isinstance(value, (int, float, bool, np.number)) else out


def broadcast(value, root_rank: int = 0):
    """Rank root_rank's value on every rank (every rank passes a value of the same shape
    and dtype). A collective.

    value: a numpy array, a TensorFlow tensor or a number; root_rank: the rank whose
    value wins. Raises InvalidArgumentError for a root_rank outside [0, size()),
    KvcollError before kv.init(), CommTimeoutError when a rank does not take part."""
    c = _need("broadcast")["comm"]
    if not 0 <= int(root_rank) < c.size:
        raise InvalidArgumentError(f"broadcast: root_rank must be in [0, {c.size}), got {root_rank}")
    arr, back = _as_numpy(value)
    return back(c.bcast(np.ascontiguousarray(arr), root=int(root_rank), op="kv.broadcast"))


def shutdown() -> None:
    """Wait for every rank, then free kvcoll's communicators (SSP/ASP service threads
    stop first). Inside a Horovod job, a barrier through Horovod comes last, so that no
    rank starts Horovod's shutdown (which may finalize MPI on every rank) while another
    is still in kvcoll's MPI calls. A collective; safe to call twice. Call it before
    hvd.shutdown(), if the script calls that. Raises CommTimeoutError when a rank does
    not arrive within the step deadline."""
    if not _state:
        return
    from .exchange.ssp import close_all

    close_all()
    c = _state["comm"]
    horovod = _horovod_world(c)
    timeout, rank = c.timeout, c.rank
    c.barrier("shutdown")
    c.free()
    _state.clear()
    if horovod:
        _horovod_barrier(timeout, rank)


# -- inside a Horovod job (kvcoll.keras._horovod holds the rest; not imported here, as
#    that package brings Keras in) --------------------------------------------------------

def _horovod():
    """Horovod's TensorFlow layer if the program imported and initialised it (not yet
    shut down), else None."""
    hvd = sys.modules.get("horovod.tensorflow")
    return hvd if hvd is not None and hvd.is_initialized() else None


def _horovod_world(c: Comm) -> bool:
    """Whether Horovod runs (_horovod) and spans kvcoll's world: then its shutdown can
    finalize MPI under kvcoll."""
    hvd = _horovod()
    return hvd is not None and (hvd.size(), hvd.rank()) == (c.size, c.rank)


# what needs MPI_THREAD_MULTIPLE inside a Horovod job (kvcoll.comm.threads_refused)
BESIDE_HOROVOD = ("kvcoll next to Horovod (Horovod's background thread calls MPI while "
                  "kvcoll's collectives run on the training thread)")


def _horovod_threads() -> None:
    """Before kv.init's first collective: inside a Horovod job whose MPI runs below
    MPI_THREAD_MULTIPLE (hvd.init() first, with HOROVOD_MPI_THREADS_DISABLE), Horovod's
    background thread already calls MPI, and kvcoll's collectives on this thread beside
    it may crash the process (a rank crashed in Open MPI's NBC_Progress): refuse, naming
    the fix, on every rank alike (the thread level is the job's), before any.

    It asks Horovod (the thread level its MPI start got, as Horovod keeps it), not MPI:
    a rank that refused and exited shuts Horovod down on every rank, and each rank's
    Horovod thread then finalizes MPI, under a rank still here (an MPI call there
    aborted the process). Horovod without MPI (Gloo) never calls MPI: nothing to check."""
    hvd = _horovod()
    if hvd is None:
        return
    try:
        multiple = hvd.mpi_threads_supported()
    except ValueError:      # Horovod runs without MPI
        return
    if not multiple:
        raise threads_refused(BESIDE_HOROVOD, hvd.rank(),
                              "less (Horovod's hvd.mpi_threads_supported() is False)")


def _horovod_barrier(timeout: float, rank: int) -> None:
    """Wait until every rank is here, through Horovod's allreduce (run by its background
    thread): kvcoll's last synchronisation inside a Horovod job. It waits at most
    `timeout` seconds (the op runs in a helper thread) and then raises
    CommTimeoutError naming the rank."""
    import tensorflow as tf

    hvd = sys.modules["horovod.tensorflow"]
    failed: list = []

    def run():
        try:
            hvd.allreduce(tf.zeros([1], tf.float32), op=hvd.Sum, name="kvcoll.shutdown").numpy()
        except Exception as exc:  # noqa: BLE001 - raised on the calling thread below
            failed.append(exc)

    try:
        t = threading.Thread(target=run, name="kvcoll-shutdown", daemon=True)
        t.start()
    except RuntimeError:  # no new threads at interpreter shutdown (Python >= 3.12)
        run()
    else:
        t.join(timeout)
        if t.is_alive():
            raise CommTimeoutError(
                f"rank {rank}: shutdown: Horovod's barrier did not complete within "
                f"{timeout:g}s; a rank died, stopped, or did not call kv.shutdown() (or "
                "exit) while Horovod ran (raise the limit with KVCOLL_COMM_TIMEOUT)")
    if failed:
        raise CommError(f"rank {rank}: shutdown: Horovod's barrier failed: {failed[0]}; "
                        "call kv.shutdown() before hvd.shutdown()") from failed[0]
