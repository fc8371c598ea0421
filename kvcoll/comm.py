"""The only module that calls MPI.

kvcoll talks on its own duplicate of COMM_WORLD, so its messages never match a
user's. Every collective is non-blocking underneath and waited for with a deadline:
a collective that outlives it raises CommTimeoutError naming the rank and the
operation, and the uncaught-exception hooks installed by `init` (the main thread's and
every other thread's) abort the whole job (mpi4py's `-m mpi4py` runner does the same),
so no rank is left waiting. Deadlines come by kind (`timeouts`): "step" for a training
step's exchanges, "io" for checkpoints and exports, "startup" for bringing kvcoll up;
`with comm.deadline("io"):` switches a block to another kind.

A collective that times out cannot say by itself which peer is missing, so the rank
asks: on a liveness channel of its own (a second private communicator) it pings every
peer and waits LIVENESS_GRACE seconds; a rank that waits in any kvcoll call answers
at once with what it waits in and at which step. Only an answer to this very ping is a
sign of life (a ping a peer sent earlier is not: it may have stopped or died since).
The error then names the ranks that made no progress and gave no sign of life, with
their pid and host (every rank learns the others' when the communicator is made), and,
for a rank on the same machine, what its process is doing (stopped, running outside
kvcoll, exited: read from /proc); the operation; and the step (`Comm.step`, which the
exchanges keep current). Before the channel exists (kv.init's own communicators) the
ping goes over the parent communicator, with tags of kvcoll's own. MPI_Init itself
waits for every rank of the job, in C, where no deadline of Python's runs: a watchdog
process ends a rank whose MPI_Init outlives the start-up deadline, saying why.

Deadlines count the time this process ran (`run_time`): a rank that was stopped
(SIGSTOP, Ctrl-Z, a paused VM) and continued does not blame a peer for its own pause,
and if it was paused during a wait that then timed out, the error says so. If MPI_Abort
cannot end the process (its launcher is unreachable), the process exits by itself
ABORT_EXIT_AFTER seconds later, so a rank on a host cut off from the others never
lingers.

Validate before a collective, never raise inside one on a single rank: `agree()`
lets every rank learn that some rank's input was bad and raise the same error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from ._buffers import aligned_empty
from ._topology import (
    TOPOLOGIES,
    Topology,
    level1_order,
    level2_order,
    permute_blocks,
    plan,
    source_order,
)
from .errors import CommError, CommTimeoutError, PeerLostError

__all__ = ["AllToAllHandle", "Comm", "MessageWaiter", "SendHandle", "TwoLevelHandle", "announce",
           "paused", "run_time", "threads_refused"]

_MPI = None


def skip_finalize() -> None:
    """Do not run MPI_Finalize at exit (mpi4py.rc.finalize = False; before MPI is up):
    an elastic run's (kvcoll.elastic), where it may hang after a peer was lost (Open MPI
    issue 11404) or with ULFM's detector thread. Exit codes are kept. (If something
    imported mpi4py.MPI before kv.init(), its MPI_Finalize stays.)"""
    if _MPI is None and "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.finalize = False


def _mpi(limit: float | None = None):
    """Import mpi4py with full thread support (the SSP/ASP service thread needs it).
    limit: the start-up deadline for MPI_Init, which the import runs (see
    _init_watchdog); None: no watchdog (MPI is up already, or a caller that needs none)."""
    global _MPI
    if _MPI is None:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        starting = "mpi4py.MPI" not in sys.modules   # (else MPI is up already)
        if starting:
            _guard_ulfm_start()
        dog = _init_watchdog(limit) if limit and starting else None
        try:
            from mpi4py import MPI
        finally:
            if dog is not None:
                dog.stdin.close()          # MPI is up: the watchdog exits
                try:
                    dog.wait(timeout=5)
                except subprocess.TimeoutExpired:  # pragma: no cover - a stuck watchdog
                    dog.kill()
        _MPI = MPI
    return _MPI


# Open MPI 5.0's transports hand each message to the callback registered for its tag, with
# no check that there is one. ULFM's reliable broadcast (the failure detector's heartbeats)
# registers its tag in MPI_Init after the first start-up fence; with the detector thread
# (kvcollrun's setting), a rank that leaves that fence starts its detector at once and
# sends its first heartbeat, so a peer still inside the fence (a busy host delays its
# release) receives it with no callback and crashes in MPI_Init (a segmentation fault at
# address 0: 4 of 200 starts of 2 ranks under ULFM on this 2-core machine with two busy
# processes beside them; 0 of 200 without the detector thread). Before MPI_Init, kvcoll
# fills that empty slot with a callback that drops the message; MPI_Init registers its
# own over it. A heartbeat lost then costs nothing: each detector allows for the start-up.
# (With this, 0 of 250 starts crashed in the same conditions: tests/launch/ulfm_start.py.)
_ULFM_RBCAST_TAG = 0x30          # MCA_BTL_TAG_FT_RBCAST (opal/mca/btl/btl.h)


def _rbcast_slot():
    """The callback slot of ULFM's reliable broadcast in Open MPI's libopen-pal (a
    ctypes pointer: its .value is the callback's address, None while empty), or None
    when this process's mpi4py does not run on Open MPI. Loads mpi4py's extension as a
    library only (no module init: MPI stays down)."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("mpi4py.MPI")
    try:
        ctypes.CDLL(spec.origin, mode=os.RTLD_LAZY)
        with open("/proc/self/maps") as f:
            pal = next((line.split(None, 5)[5].strip() for line in f
                        if "/libopen-pal.so" in line), None)
        if pal is None:
            return None
        trigger = ctypes.c_void_p.in_dll(ctypes.CDLL(pal, mode=os.RTLD_NOLOAD | os.RTLD_LAZY),
                                         "mca_btl_base_active_message_trigger")
    except (OSError, ValueError, AttributeError):
        return None
    # the slots are {callback, data} pairs, one per tag
    return ctypes.c_void_p.from_address(ctypes.addressof(trigger)
                                        + _ULFM_RBCAST_TAG * 2 * ctypes.sizeof(ctypes.c_void_p))


def _drop_callback() -> int:
    """The address of csrc's kv_poll_drop (a transport callback that drops the message)."""
    from ._c import ffi, lib

    return int(ffi.cast("uintptr_t", ffi.addressof(lib, "kv_poll_drop")))


def _guard_ulfm_start() -> bool:
    """Fill the empty callback slot of ULFM's reliable broadcast (see above) when this
    process runs under ULFM (OMPI_MCA_mpi_ft_enable, set by `mpirun --with-ft ulfm`).
    Call before MPI_Init. True if it filled the slot."""
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return False
    slot = _rbcast_slot()
    if slot is None or slot.value:
        return False
    slot.value = _drop_callback()
    return True


def threads_refused(what: str, rank: int, level) -> CommError:
    """The error when `what` (a second thread calling MPI) needs MPI_THREAD_MULTIPLE and
    MPI runs with `level` (its name) on `rank`; it names the fix."""
    return CommError(
        f"rank {rank}: {what} needs MPI initialised with MPI_THREAD_MULTIPLE, "
        f"but it runs with {level}; "
        "initialise MPI through kvcoll (kv.init() before anything else imports "
        "mpi4py.MPI), or set mpi4py.rc.thread_level = 'multiple' before importing "
        "mpi4py.MPI (Horovod: HOROVOD_MPI_THREADS_DISABLE must not be set)")


# The watchdog of MPI_Init (a separate process: MPI_Init holds the GIL, so no thread of
# this process can run meanwhile). It waits for its stdin to close (MPI is up) for at
# most the deadline; then it says why, and which processes of the job on this host are
# stopped, and kills the rank, so that the launcher ends the whole job.
_WATCHDOG = r"""
import os, select, sys
pid, limit, who, var = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
if select.select([0], [], [], limit)[0]:
    sys.exit(0)
def stat(p):
    try:
        with open(f"/proc/{p}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
me = stat(pid)
if me is None:
    sys.exit(0)
if me[0] in "Tt":
    why = "this rank is itself stopped (SIGSTOP, Ctrl-Z or a debugger)"
else:
    stopped = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != pid
                     and (st := stat(p)) is not None and st[1] == me[1] and st[0] in "Tt")
    here = (f"on this host, process(es) {stopped} of the same launcher are stopped "
            f"(SIGSTOP, Ctrl-Z or a debugger; kill -CONT resumes them)" if stopped else
            "no other process of the same launcher on this host is stopped")
    why = (f"it waits for every rank of the job, and some rank has not started MPI: it is "
           f"stopped, stuck or slow before kv.init(), or dead ({here})")
sys.stderr.write(f"kvcoll: {who}: starting MPI (MPI_Init, in kv.init()) did not complete "
                 f"within {limit:g}s: {why}; ending this rank so that the launcher ends the "
                 f"job (raise the limit with {var})\n")
sys.stderr.flush()
os.kill(pid, 9)
"""


def _launch_rank() -> tuple[str | None, int]:
    """This process's rank and the job's size as its launcher set them (before MPI is
    up): (rank or None, size; 1 when not started by an MPI launcher)."""
    env = os.environ
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                       ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "OMPI_UNIVERSE_SIZE")):
        if rank in env:
            try:
                return env[rank], int(env.get(size, "0"))
            except ValueError:
                return env[rank], 0
    return None, 1


def _init_watchdog(limit: float):
    """Start the watchdog of MPI_Init (see _WATCHDOG) when this process is one rank of
    several; None otherwise (MPI_Init of a single process waits for nobody)."""
    rank, size = _launch_rank()
    if rank is None or size == 1:
        return None
    who = f"rank {rank}{f'/{size}' if size else ''} (pid {os.getpid()} on host " \
          f"{socket.gethostname()})"
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()),
                                 str(limit), who, _TIMEOUT_VARS["startup"]],
                                stdin=subprocess.PIPE)
    except OSError:  # pragma: no cover - no watchdog then, as before
        return None


def _mpi_type(dtype: np.dtype):
    MPI = _mpi()
    return {
        np.dtype(np.int64): MPI.INT64_T,
        np.dtype(np.int32): MPI.INT32_T,
        np.dtype(np.uint16): MPI.UINT16_T,   # 16-bit rows on the wire (exchange/wire.py)
        np.dtype(np.uint8): MPI.UINT8_T,
        np.dtype(np.float32): MPI.FLOAT,
        np.dtype(np.float64): MPI.DOUBLE,
    }[np.dtype(dtype)]


_run_lock = threading.Lock()
_run_last = time.monotonic()   # the last read of the clock, by any thread
_run_paused = 0.0              # the gaps longer than STALLED between two reads
_last_pause = (0.0, 0.0)       # the latest such gap within a wait: (run_time() at its end, s)
_in_waits = 0                  # how many threads wait in kvcoll (Comm.waiting) right now


def _read_clock(enter: int = 0) -> tuple[float, float]:
    """(run_time, paused); enter: +1 / -1 as a thread starts / ends a wait."""
    global _run_last, _run_paused, _last_pause, _in_waits
    with _run_lock:
        now = time.monotonic()
        gap = now - _run_last
        if gap > STALLED:
            _run_paused += gap
            if _in_waits:  # a pause for sure (a wait reads often), not a gap between waits
                _last_pause = (now - _run_paused, gap)
        _run_last = now
        _in_waits += enter
        return now - _run_paused, _run_paused


def run_time() -> float:
    """Seconds on a monotonic clock that stands still while this process does not run:
    time.monotonic() less every gap longer than STALLED between two reads of it (by any
    thread). Every wait of kvcoll's reads it at least every 50 ms, so a gap within a
    wait is a pause of this process (stopped with SIGSTOP and continued, a paused VM),
    never a peer's silence: a deadline on this clock does not pass while the process is
    stopped. (Between waits gaps are normal: only differences within a wait count.)"""
    return _read_clock()[0]


def paused() -> float:
    """Seconds this process did not run, summed over the gaps run_time() left out; the
    difference over a wait is how long this process was stopped during it."""
    return _read_clock()[1]


def _pause_note(own: float) -> str:
    """Words on this process's own pause of `own` seconds during a wait, or ''."""
    if own <= 0:
        return ""
    return (f" (this rank itself did not run for {own:.0f}s of that: it was stopped or "
            "paused, while its peers' deadlines ran on)")


def _poll_until(ready, limit: float, message, spin: float = 0.0, idle=None) -> None:
    """Call ready() until it returns True; after `limit` seconds raise
    CommTimeoutError(message()). For the first `spin` seconds it polls back to back,
    yielding the core (and the GIL) between polls, so a peer that is a moment late
    costs microseconds, not a sleep; then it sleeps with back-off (20 us doubling to
    1 ms): a long wait never spins. idle(), if given, is called between the sleeps
    (it answers the peers' liveness pings). In both phases a gap of more than STALLED
    seconds between two polls (which are at most 1 ms apart) is a pause of this process
    (stopped with SIGSTOP and continued, a paused VM): it moves the deadline on, since
    no peer can be blamed for it (as run_time() leaves it out)."""
    if ready():
        return
    last = time.monotonic()
    deadline, spin_until = last + limit, last + min(spin, limit)
    pause = 20e-6
    while True:
        now = time.monotonic()
        if now - last > STALLED:  # this process did not run: no peer's fault
            deadline += now - last
            spin_until += now - last
        last = now
        if now < spin_until:
            os.sched_yield()
        else:
            run_time()  # the process-wide clock sees the pause too (for the error's note)
            if now > deadline:
                raise CommTimeoutError(message())
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            if idle is not None:
                idle()
        if ready():
            return


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22): with
    the pid it names one process, even after the pid is reused. None: no such process."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _read(path: str, how=str.strip) -> str:
    try:
        with open(path) as f:
            return how(f.read())
    except OSError:
        return ""


def _identity() -> dict:
    """This process as its peers name it (host, pid) and find it again (the boot and
    the pid namespace: a peer that shares both sees this process in its own /proc;
    the start time, against a reused pid)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": ns,
            "start": _start_time(os.getpid()), "launch_rank": _launch_rank()[0]}


def _topology_host() -> str | None:
    """This process's host as the exchange's topology groups ranks: its host name; or,
    for kvcoll's own tests only, its label in KVCOLL_TEST_HOSTS (one comma-separated
    label per launch rank, e.g. "a,a,b,b": a host split pretended on one machine).
    None: that variable has no label for this rank (every rank then refuses it)."""
    labels = os.environ.get("KVCOLL_TEST_HOSTS")
    if not labels:
        return socket.gethostname()
    rank, _ = _launch_rank()
    try:
        return labels.split(",")[int(rank)] or None
    except (TypeError, ValueError, IndexError):
        return None


def _proc_state(ident: dict, me: dict | None = None) -> str | None:
    """What the process `ident` (see _identity) is doing, seen from this one (`me`:
    this process's identity): "stopped", "running" (or sleeping: not stopped), "exited",
    or None when it cannot be seen from here (another machine or pid namespace)."""
    me = me or _identity()
    if not ident.get("boot") or not ident.get("pidns") or ident.get("start") is None \
            or (ident["boot"], ident["pidns"]) != (me.get("boot"), me.get("pidns")):
        return None
    fields = _proc_stat(int(ident["pid"]))
    if fields is None or int(fields[19]) != ident["start"] or fields[0] in "ZXx":
        return "exited"
    return "stopped" if fields[0] in "Tt" else "running"


def _describe_silent(rank: int, ident: dict | None, me: dict | None = None) -> str:
    """A rank that gave no sign of life, for an error: its pid and host, and what its
    process is doing when this process can see it (same machine). ident: its identity
    (None: it never joined, so neither is known)."""
    if ident is None:
        return (f"rank {rank} (host not known: it has not joined kvcoll) is stopped, stuck "
                "or slow before kv.init(), dead, or cut off from this rank")
    pid = ident["pid"]
    who = f"rank {rank} (pid {pid} on host {ident['host']})"
    state = _proc_state(ident, me)
    if state == "stopped":
        return f"{who} is stopped (SIGSTOP, Ctrl-Z or a debugger; kill -CONT {pid} resumes it)"
    if state == "running":
        return (f"{who} is running but not waiting in kvcoll: busy in other code or stuck "
                "(a deadlock, a long computation, a blocking call)")
    if state == "exited":
        return f"{who} has exited"
    return f"{who} is stopped, stuck outside kvcoll, dead, or cut off from this rank"


# The setting that raises each kind of deadline.
_TIMEOUT_VARS = {"step": "KVCOLL_COMM_TIMEOUT", "io": "KVCOLL_IO_TIMEOUT",
                 "startup": "KVCOLL_STARTUP_TIMEOUT"}

# How long a wait that should end soon polls back to back before it starts sleeping:
# a BSP step's collectives (the ranks run in lock step), or an SSP/ASP pull's reply
# (due as soon as the owner has served it).
SPIN = 5e-3

# After a collective's deadline: how long a rank waits for its peers' sign of life
# before naming the silent ones (a peer waiting in kvcoll answers within milliseconds).
LIVENESS_GRACE = 2.0

# A pause between two polls of a wait longer than this is this process's own (it was
# stopped or descheduled), not a peer's silence: polls are at most 1 ms apart.
STALLED = 1.0

# After MPI_Abort: how long a rank waits for MPI to end it before it exits by itself.
ABORT_EXIT_AFTER = 5.0


# The tags of the liveness pings and answers on the parent communicator, before kvcoll's
# own channel exists (kv.init's communicators): high, so that a user's tags never match
# them (only a user's MPI.ANY_TAG receive could take one, and only once a start-up
# deadline has passed and the job is ending anyway).
_STARTUP_TAGS = (32761, 32762)


class _Liveness:
    """The liveness channel: a private communicator, shared by a Comm and its dups, on
    which a rank whose collective timed out pings its peers (`diagnose`) and every rank
    waiting in kvcoll answers (`answer`, called between the sleeps of every wait) with
    the operation and step it waits in. Only non-blocking calls: a dead peer's messages
    are never waited for. peers: every rank's identity (see _identity), once known.
    owns: whether free() frees the communicator (not when it is the parent's, borrowed
    with tags of its own until the channel exists)."""

    _SIZE = 256  # bytes per message: kind, sequence, step (int64), then the op (utf-8)

    def __init__(self, comm, owns: bool = True, tags: tuple[int, int] = (31, 32)):
        self.comm, self.owns = comm, owns
        self._PING, self._PONG = tags
        self.peers: list | None = None
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._waits: dict[int, tuple[str, int | None]] = {}  # thread id -> (op, step)
        self._sends: list = []  # (request, buffer): kept alive until MPI is done with them
        self._seq = 0
        self._lock = threading.Lock()
        self._next_answer = 0.0

    @contextlib.contextmanager
    def waiting(self, op: str, step: int | None):
        """Within the block, this thread waits in `op` at `step` (what answers report)."""
        me = threading.get_ident()
        self._waits[me] = (op, step)
        try:
            yield
        finally:
            self._waits.pop(me, None)

    def _pack(self, kind: int, seq: int) -> np.ndarray:
        waits = list(self._waits.values())
        op, step = waits[0] if waits else ("nothing (busy outside kvcoll)", None)
        buf = np.zeros(self._SIZE, np.uint8)
        buf[:24].view(np.int64)[:] = (kind, seq, -1 if step is None else step)
        text = op.encode()[:self._SIZE - 24]
        buf[24:24 + len(text)] = np.frombuffer(text, np.uint8)
        return buf

    @classmethod
    def _unpack(cls, buf: np.ndarray) -> tuple[int, int, str, int | None]:
        kind, seq, step = (int(x) for x in buf[:24].view(np.int64))
        op = buf[24:].tobytes().rstrip(b"\0").decode(errors="replace")
        return kind, seq, op, None if step < 0 else step

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        self._sends.append((self.comm.Isend([buf, _mpi().BYTE], dest, tag), buf))

    def _take(self, tag: int):
        """One arrived message with `tag`: (source, kind, seq, op, step), or None."""
        MPI = _mpi()
        status = MPI.Status()
        msg = self.comm.Improbe(MPI.ANY_SOURCE, tag, status)
        if msg is None:
            return None
        buf = np.empty(self._SIZE, np.uint8)
        msg.Recv([buf, MPI.BYTE])
        return (status.Get_source(), *self._unpack(buf))

    def _answer_pings(self) -> None:
        while (got := self._take(self._PING)) is not None:
            src, _, seq, _, _ = got
            self._send(self._pack(self._PONG, seq), src, self._PONG)

    def answer(self) -> None:
        """Answer the pings that have arrived (at most every 10 ms; never blocks)."""
        now = time.monotonic()
        if now < self._next_answer or not self._lock.acquire(blocking=False):
            return
        try:
            self._next_answer = now + 0.01
            self._answer_pings()
        finally:
            self._lock.release()

    def diagnose(self, grace: float) -> dict:
        """Ping every peer and wait up to `grace` seconds (of run_time): {rank: (op,
        step)} of the peers that answered this ping. The others are lost. A ping that a
        peer sent is answered but is no sign of life: it may be from before the peer
        stopped or died (a peer diagnosing at the same time answers this ping too)."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            for peer in range(self.size):
                if peer != self.rank:
                    self._send(self._pack(self._PING, seq), peer, self._PING)
            heard: dict = {}
            deadline = run_time() + grace
            while len(heard) < self.size - 1 and run_time() < deadline:
                self._answer_pings()
                while (got := self._take(self._PONG)) is not None:
                    src, _, answered, op, step = got
                    if answered == seq:
                        heard[src] = (op, step)
                time.sleep(1e-3)
            return heard

    def free(self) -> None:
        if self.owns:
            self.comm.Free()


def _at(step) -> str:
    return "" if step is None else f" at step {step}"


class Comm:
    """kvcoll's communicator: a Dup of a parent (COMM_WORLD by default).

    timeout: the "step" deadline in seconds; timeouts: the other kinds' ("io",
    "startup"; default: the step's). The duplication itself (and that of the liveness
    channel, shared with the dups) waits at most the "startup" deadline.

    step: the training step the caller is in (None: not training yet), named in
    timeout errors; the exchanges set it.

    elastic: the run survives a lost peer (Open MPI's ULFM, `mpirun --with-ft ulfm`): an
    error of a lost peer in any wait revokes the communicator (so that every rank's
    waits on it end at once) and raises PeerLostError; `consensus`, `revoke` and
    `shrink` are what the survivors recover with (kvcoll.elastic).

    topology: how its all-to-alls go (kvcoll._topology): "auto" (default; two-level when
    the world spans several hosts of the same number of ranks, more than one), "flat" or
    "two-level" (InvalidArgumentError, on every rank alike, where hosts differ in size).
    `self.topology` says what was chosen and why; a two-level Comm makes its two
    sub-communicators (by host, by local rank) with it, and a dup its own. Every rank
    must pass the same setting (else CommError on every rank).

    messages: per operation, the point-to-point messages this rank sent to other ranks
    for its all-to-alls (a flat one's MPI all-to-all counts one per peer and phase)."""

    def __init__(self, parent=None, timeout: float = 300.0, timeouts: dict | None = None,
                 _live: _Liveness | None = None, elastic: bool = False,
                 topology: str = "auto", _strict: bool = True):
        self.timeouts = {"step": float(timeout), "io": float(timeout),
                         "startup": float(timeout), **(timeouts or {})}
        MPI = _mpi(self.timeouts["startup"])
        self.timeout, self.kind = self.timeouts["startup"], "startup"
        self.rank = -1
        self.size = 0
        self.step: int | None = None
        self.calls: dict[str, int] = {}  # per operation name: how many times issued
        self.messages: dict[str, int] = {}  # per operation name: messages sent to peers
        self.elastic = bool(elastic)
        if topology not in TOPOLOGIES:
            plan([], topology)  # raises InvalidArgumentError naming the choices
        self._topology_setting = topology
        self.topology: Topology = Topology("flat", None, "not planned yet")
        self._two: _TwoLevel | None = None
        self.gate = None    # elastic: the step's commit vote (kvcoll.elastic), or None
        self.agree_error: str | None = None  # the last consensus's MPI error, if any
        self._live, self._owns_live = _live, False
        self._comm = None
        parent = parent if parent is not None else MPI.COMM_WORLD
        self.rank, self.size = parent.Get_rank(), parent.Get_size()
        first = self._live is None and self.size > 1
        if first:  # until the channel exists, pings go over the parent (tags of our own)
            self._live = _Liveness(parent, owns=False, tags=_STARTUP_TAGS)
        try:
            comm, req = parent.Idup()
            self.wait(req, "dup (a new communicator: every rank must create it)")
            self._comm = comm
            if first:
                live, req = comm.Idup()
                self.wait(req, "dup (the liveness channel: every rank must create it)")
                self._live, self._owns_live = _Liveness(live), True
                self._live.peers = self.allgather_json(
                    {**_identity(), "topology_host": _topology_host(),
                     "exchange_topology": topology}, op="dup:identities")
            self.thread_level = MPI.Query_thread()
            self._plan_topology(topology, _strict)
        except (CommError, CommTimeoutError):
            if first and _ABORT["comm"] is None:  # uncaught, end the job (else MPI_Finalize
                install_abort_hook(_ParentAbort(parent))  # at exit waits for the lost rank)
            raise
        self.timeout, self.kind = self.timeouts["step"], "step"

    def _plan_topology(self, setting: str, strict: bool) -> None:
        """Choose flat or two-level from every rank's host (the same list on every rank,
        so every rank decides alike, raising alike) and make the sub-communicators."""
        peers = self.peers
        settings = sorted({str(p.get("exchange_topology", setting)) for p in peers})
        if len(settings) > 1:
            raise CommError(f"rank {self.rank}: the ranks were given different "
                            f"exchange_topology settings {settings}; give every rank the same "
                            "(kv.init(exchange_topology=...), --exchange-topology or "
                            "KVCOLL_EXCHANGE_TOPOLOGY)")
        labels = [p.get("topology_host", p["host"]) for p in peers]
        if any(h is None for h in labels):
            raise CommError(f"rank {self.rank}: KVCOLL_TEST_HOSTS (kvcoll's tests only) must "
                            "give a host label to every launch rank, comma-separated, e.g. "
                            f"a,a,b,b; got {os.environ.get('KVCOLL_TEST_HOSTS')!r}")
        self.topology = plan(labels, setting, strict)
        if self.topology.two_level and self.size > 1:
            self._two = _TwoLevel(self)

    def _split(self, color: int, key: int, op: str):
        """MPI_Comm_split of this communicator, waited with the current deadline like
        every collective here: in a helper thread when MPI runs threaded (the blocking
        call has no non-blocking form), while this thread answers liveness pings and
        names the ranks that did not come; else after a barrier with the deadline."""
        MPI = _mpi()
        self._count(op)
        if self.thread_level < MPI.THREAD_MULTIPLE:
            self.barrier(op)
            return self._comm.Split(color, key)
        box: list = []

        def run():
            try:
                box.append(self._comm.Split(color, key))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box.append(exc)

        threading.Thread(target=run, name="kvcoll-split", daemon=True).start()
        with self.waiting(op):
            before = _run_paused
            _poll_until(lambda: bool(box), self.timeout,
                        lambda: self._timed_out(op, None, paused() - before), spin=SPIN,
                        idle=self.answer_liveness)
        if isinstance(box[0], MPI.Exception):
            raise self.lost(box[0], op)
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _sent(self, op: str, n: int) -> None:
        self.messages[op] = self.messages.get(op, 0) + n

    @property
    def peers(self) -> list[dict]:
        """Every rank's process, in rank order: {"host", "pid", ...} (see _identity)."""
        live = self._live
        return live.peers if live is not None and live.peers is not None else [_identity()]

    @property
    def hosts(self) -> list[str]:
        """Every rank's host name, in rank order."""
        return [p["host"] for p in self.peers]

    @classmethod
    def local(cls, timeout: float = 300.0) -> Comm:
        """A one-rank communicator of this process alone (reference runs, tests)."""
        return cls(_mpi().COMM_SELF, timeout)

    @contextlib.contextmanager
    def deadline(self, kind: str):
        """Wait up to the `kind` deadline ("step", "io", "startup") inside the block."""
        prev = self.timeout, self.kind
        self.timeout, self.kind = self.timeouts[kind], kind
        try:
            yield self
        finally:
            self.timeout, self.kind = prev

    @property
    def hint(self) -> str:
        """How to raise the current deadline."""
        return f"raise the limit with {_TIMEOUT_VARS[self.kind]}"

    def require_threads(self, what: str) -> None:
        """Raise CommError (naming the fix) unless MPI runs with MPI_THREAD_MULTIPLE,
        which `what` (a second thread calling MPI) needs."""
        MPI, level = _mpi(), self.thread_level
        if level < MPI.THREAD_MULTIPLE:
            names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
                     "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
            raise threads_refused(what, self.rank, names.get(level, level))

    # -- plumbing --------------------------------------------------------------------

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def wait(self, req, op: str, peer: int | None = None) -> None:
        """Wait for a request (polling, see _poll_until); raise CommTimeoutError after
        `timeout` s, naming the ranks that gave no sign of life (see `liveness`); `peer`:
        the rank a point-to-point request goes to."""
        since = time.monotonic()
        two = self._two
        if two is None:
            ready = req.Test
        else:  # the two-level all-to-alls in flight go on meanwhile (see _TwoLevel)
            def ready():
                two.progress()
                return req.Test()
        try:
            if ready():
                return
            with self.waiting(op):
                before = _run_paused  # read by waiting() just now
                _poll_until(ready, self.timeout,
                            lambda: self._timed_out(op, peer, paused() - before), spin=SPIN,
                            idle=self._idle_elastic if self.elastic else self.answer_liveness)
        except _mpi().Exception as exc:
            raise self.lost(exc, op, since) from None

    def _idle_elastic(self) -> None:
        """While an elastic run waits: a peer that revoked the communicator ends the wait
        with MPI_ERR_REVOKED. (Revoke does not always complete a pending nonblocking
        collective: a survivor of a stopped rank stayed in the step's gradient exchange
        until its deadline while the others waited for it in the agreement.)"""
        self.answer_liveness()
        comm = self._comm
        if comm is not None and comm.Is_revoked():
            MPI = _mpi()
            raise MPI.Exception(MPI.ERR_REVOKED)

    def _timed_out(self, op: str, peer: int | None, own_pause: float = 0.0) -> str:
        head = (f"rank {self.rank}/{self.size}: {op}{_at(self.step)} did not complete within "
                f"{self.timeout:g}s{_pause_note(own_pause)}")
        lost, report = self.liveness()
        if lost is None:
            who = f"rank {peer}" if peer is not None else "a peer"
            return f"{head}; {who} died, stopped or did not issue the same call ({self.hint})"
        if lost or peer is not None:
            return f"{head}: {report} ({self.hint})"
        return (f"{head}, yet {report}: the ranks issued different calls (every rank must "
                f"issue kvcoll's collectives in the same order), or one is slower than the "
                f"deadline ({self.hint})")

    @contextlib.contextmanager
    def waiting(self, op: str):
        """Within the block this thread waits in `op` (at self.step): what it answers its
        peers' liveness pings. For waits of one's own (a loop on a condition); call
        answer_liveness() in the loop."""
        live = self._live
        _read_clock(+1)  # a gap since the last read is no pause within this wait
        try:
            with live.waiting(op, self.step) if live else contextlib.nullcontext():
                yield
        finally:
            _read_clock(-1)

    def answer_liveness(self) -> None:
        """Answer the peers' liveness pings that have arrived (never blocks). Waits of
        one's own call it every few ms: it reads run_time() too, to notice a pause."""
        run_time()
        if self._live is not None:
            self._live.answer()

    def liveness(self, grace: float | None = None) -> tuple[list | None, str]:
        """Ask every peer whether it is alive, waiting up to `grace` s (default
        LIVENESS_GRACE, at most the deadline): (the ranks that gave no sign of life, a
        sentence saying who is lost, with the pid and host of each and what its process
        is doing when it runs on this machine, and what the others wait in); (None, "")
        without a liveness channel (one rank)."""
        if self._live is None:
            return None, ""
        grace = min(LIVENESS_GRACE, self.timeout) if grace is None else grace
        heard = self._live.diagnose(grace)
        lost = [r for r in range(self.size) if r != self.rank and r not in heard]
        alive = "; ".join(f"rank {r} waits in {o}{_at(s)}"
                          for r, (o, s) in sorted(heard.items()))
        if not lost:
            return lost, f"every rank is alive ({alive})" + self._recent_pause()
        return lost, (f"lost rank(s) {lost}, no progress and no sign of life within "
                      f"{grace:g}s: {self.describe(lost)}" + (f"; alive: {alive}" if alive else "")
                      + self._recent_pause())

    def describe(self, ranks) -> str:
        """The given ranks, as a timeout error names a lost rank: each with its pid and
        host, and, for one on this machine, whether its process is stopped, running
        outside kvcoll or has exited (read from /proc; nothing is sent)."""
        live = self._live
        peers = live.peers if live is not None else None
        me = peers[self.rank] if peers else _identity()
        return "; ".join(_describe_silent(r, peers[r] if peers else None, me) for r in ranks)

    def _recent_pause(self) -> str:
        """Words on a pause of this process that ended within the deadline (and the
        liveness check) before now, or '': its peers may have given up on it meanwhile."""
        ended, length = _last_pause
        ago = run_time() - ended
        if not length or ago > self.timeout + 2 * LIVENESS_GRACE:
            return ""
        return (f"; and this rank itself did not run for {length:.0f}s until {ago:.0f}s ago "
                "(it was stopped or paused: its peers' deadlines ran on meanwhile)")

    def dup(self) -> Comm:
        """Another private communicator over the same ranks (e.g. for a service thread):
        a collective, with the startup deadline. It shares this one's liveness channel."""
        c = Comm(self._comm, self.timeouts["step"], self.timeouts, _live=self._live,
                 elastic=self.elastic, topology=self._topology_setting)
        c.gate = self.gate
        return c

    # -- a lost peer (elastic runs) -----------------------------------------------------

    def lost(self, exc, op: str, since: float | None = None) -> BaseException:
        """The error to raise for an MPI error `exc` in `op`: PeerLostError for a lost
        peer (MPI_ERR_PROC_FAILED, its _PENDING form, MPI_ERR_REVOKED), after revoking
        this communicator so that every rank learns of it; CommError otherwise."""
        MPI = _mpi()
        try:
            code = exc.Get_error_class()
        except Exception:  # noqa: BLE001 - not an MPI error object
            code = None
        lost_codes = {getattr(MPI, n, -1) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                    "ERR_REVOKED")}
        if code not in lost_codes:
            return CommError(f"rank {self.rank}/{self.size}: {op}{_at(self.step)} failed: "
                             f"{exc}")
        text = _mpi_error_text(exc)
        self.revoke(f"{op}: {text}")
        ranks = self.failed_ranks()
        who = (f"lost {self.describe(ranks)}" if ranks else
               f"{text}: another rank lost a peer and revoked the communicator")
        return PeerLostError(f"rank {self.rank}/{self.size}: {op}{_at(self.step)}: {who}",
                             ranks, op, since)

    def revoke(self, why: str) -> None:
        """Revoke the communicator (ULFM): every rank's pending and later operations on it
        end with MPI_ERR_REVOKED, wherever they wait. Once is enough; safe to repeat. The
        rank that revokes it says so on stderr, with `why`: the other ranks' errors say
        only that it was revoked."""
        if self._comm is None:
            return
        try:
            if not self._comm.Is_revoked():
                self._comm.Revoke()
                sys.stderr.write(f"kvcoll: rank {self.rank}/{self.size} revoked its "
                                 f"communicator{_at(self.step)}: {why}\n")
                sys.stderr.flush()
        except _mpi().Exception:  # pragma: no cover - a runtime without ULFM
            pass
        if self._two is not None:
            self._two.revoke()

    def failed_ranks(self) -> list[int]:
        """The ranks of this communicator this process knows have failed (ULFM)."""
        MPI = _mpi()
        if self._comm is None:
            return []
        try:
            group = self._comm.Get_failed()
        except (MPI.Exception, AttributeError, NotImplementedError):
            return []
        try:
            n = group.Get_size()
            if not n:
                return []
            mine = self._comm.Get_group()
            out = MPI.Group.Translate_ranks(group, list(range(n)), mine)
            mine.Free()
            return sorted(int(r) for r in out if r != MPI.UNDEFINED)
        finally:
            group.Free()

    def consensus(self, flag: bool, op: str = "consensus") -> tuple[bool, bool]:
        """ULFM's agreement (MPI_Comm_iagree): the AND of every live rank's `flag`, the same
        on every rank that returns, even when a peer failed or the communicator was
        revoked (that is what it is for). Returns (the agreed flag, whether a failure was
        reported); waits up to the current deadline. Elastic runs only."""
        MPI = _mpi()
        self._count(op)
        buf = np.array([1 if flag else 0], np.int32)
        failed = False
        self.agree_error = None
        try:
            req = self._comm.Iagree(buf)
            _poll_until(req.Test, self.timeout,
                        lambda: f"rank {self.rank}/{self.size}: {op}{_at(self.step)}: the "
                                f"survivors' agreement did not complete within "
                                f"{self.timeout:g}s ({self.hint})", spin=SPIN)
        except MPI.Exception as exc:
            failed = True
            self.agree_error = _mpi_error_text(exc)
        return bool(buf[0]), failed

    def shrink(self, op: str = "shrink") -> tuple[Comm, list[int]]:
        """The survivors' communicator (ULFM's MPI_Comm_shrink, after `revoke`): a new
        elastic Comm over the ranks that have not failed, in the same order, with a
        liveness channel of its own; and the ranks of this one that are not in it. A
        collective of the survivors, waited up to the current deadline (a thread waits in
        the blocking call; past the deadline CommTimeoutError)."""
        MPI = _mpi()
        self._count(op)
        box: list = []

        def run():
            try:
                box.append(self._comm.Shrink())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box.append(exc)

        worker = threading.Thread(target=run, name="kvcoll-shrink", daemon=True)
        worker.start()
        _poll_until(lambda: bool(box), self.timeout,
                    lambda: f"rank {self.rank}/{self.size}: {op}{_at(self.step)}: shrinking to "
                            f"the survivors did not complete within {self.timeout:g}s "
                            f"({self.hint})")
        if isinstance(box[0], BaseException):
            raise CommError(f"rank {self.rank}/{self.size}: {op}: {box[0]}")
        shrunk = box[0]
        old = self._comm.Get_group()
        new = shrunk.Get_group()
        kept = MPI.Group.Translate_ranks(new, list(range(new.Get_size())), old)
        old.Free()
        new.Free()
        lost = sorted(set(range(self.size)) - {int(r) for r in kept})
        try:  # the topology is planned again: lost hosts may leave them uneven (flat)
            comm = Comm(shrunk, self.timeouts["step"], self.timeouts, elastic=True,
                        topology=self._topology_setting, _strict=False)
        finally:
            shrunk.Free()
        if self._two is not None:  # this world's sub-communicators are done with
            self._two.free()
            self._two = None
        comm.gate = self.gate
        comm.step = self.step
        return comm, lost

    def free(self) -> None:
        if self._two is not None:
            self._two.free()
            self._two = None
        if self._comm is not None:
            self._comm.Free()
            self._comm = None
        if self._owns_live:
            self._live.free()
            self._live, self._owns_live = None, False

    def abort(self, code: int = 1) -> None:
        """End the whole job (every rank)."""
        self._comm.Abort(code)

    # -- collectives -------------------------------------------------------------------

    def barrier(self, op: str = "barrier") -> None:
        self._count(op)
        self.wait(self._comm.Ibarrier(), op)

    def allreduce(self, arr: np.ndarray, op: str = "allreduce", mpi_op=None) -> np.ndarray:
        """Elementwise sum (or `mpi_op`) of a numpy array over all ranks.

        rank 0: [1, 2]   rank 1: [10, 20]   ->   both: [11, 22]

        mpi_op may also be "sum", "max" or "min".
        """
        self._count(op)
        MPI = _mpi()
        if isinstance(mpi_op, str):
            mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[mpi_op]
        send = np.ascontiguousarray(arr)
        dt = _mpi_type(send.dtype)
        if self.size == 1:  # one rank: the result is its own array (no MPI call)
            return send.copy()
        recv = np.empty_like(send)
        req = self._comm.Iallreduce([send, dt], [recv, dt], mpi_op or MPI.SUM)
        self.wait(req, op)
        return recv

    def allgather(self, arr: np.ndarray, op: str = "allgather") -> np.ndarray:
        """Stack every rank's equal-shaped array: result[r] is rank r's.

        rank 0: [1, 2]   rank 1: [3, 4]   ->   both: [[1, 2], [3, 4]]
        """
        self._count(op)
        send = np.ascontiguousarray(arr)
        dt = _mpi_type(send.dtype)
        if self.size == 1:
            return send[None].copy()
        recv = np.empty((self.size,) + send.shape, send.dtype)
        self.wait(self._comm.Iallgather([send, dt], [recv, dt]), op)
        return recv

    def allgatherv(self, arr: np.ndarray, op: str = "allgatherv") -> tuple[np.ndarray, np.ndarray]:
        """Concatenate every rank's rows (axis 0; the other axes equal), in rank order,
        and return them with the row count of each rank.

        rank 0: [[1, 1]]   rank 1: [[2, 2], [3, 3]]
        ->  both: ([[1, 1], [2, 2], [3, 3]], [1, 2])
        """
        send = np.ascontiguousarray(arr)
        counts = self.allgather(np.array([send.shape[0]], np.int64), op=op + ":counts")[:, 0]
        self._count(op)
        width = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = np.empty((int(counts.sum()),) + send.shape[1:], send.dtype)
        rc = counts * width
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(np.int64)
        dt = _mpi_type(send.dtype)
        sbuf = send if send.size else np.zeros(1, send.dtype)
        rbuf = recv if recv.size else np.zeros(1, recv.dtype)
        req = self._comm.Iallgatherv([sbuf, send.size, dt], [rbuf, (rc, rd), dt])
        self.wait(req, op)
        return recv, counts

    def allgather_json(self, obj, op: str = "allgather_json") -> list:
        """Every rank's JSON-able object, in rank order, on every rank.

        rank 0: {"a": 1}   rank 1: None   ->   both: [{"a": 1}, None]
        """
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        buf, counts = self.allgatherv(data, op=op)
        out, at = [], 0
        for c in counts:
            out.append(json.loads(buf[at:at + int(c)].tobytes()))
            at += int(c)
        return out

    def bcast(self, arr: np.ndarray, root: int = 0, op: str = "bcast") -> np.ndarray:
        """Rank root's array on every rank (same shape and dtype everywhere)."""
        self._count(op)
        buf = np.ascontiguousarray(arr).copy()
        self.wait(self._comm.Ibcast([buf, _mpi_type(buf.dtype)], root), op)
        return buf

    def bcast_bytes(self, data: bytes | None, root: int = 0, op: str = "bcast_bytes") -> bytes:
        """Rank root's bytes on every rank (others pass None)."""
        n = np.array([len(data) if self.rank == root else 0], np.int64)
        n = self.bcast(n, root, op + ":size")
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root \
            else np.empty(int(n[0]), np.uint8)
        return self.bcast(buf, root, op).tobytes()

    def agree(self, ok: bool, what: str) -> None:
        """Collective check: if any rank passes ok=False, every rank raises CommError
        naming the ranks that failed. Use it to validate before a collective."""
        flags = self.allgather(np.array([1 if ok else 0], np.int32), op="agree:" + what)
        bad = [r for r in range(self.size) if not flags[r, 0]]
        if bad:
            raise CommError(f"rank(s) {bad} failed {what}; see their error messages")

    # -- point to point (the SSP/ASP service protocol) --------------------------------------
    #
    # Messages are flat byte buffers (np.uint8). Between one sender and one receiver on
    # one communicator they arrive in the order they were sent (MPI's non-overtaking
    # rule), whatever their tags. A receive side must be used by one thread only: the
    # SSP/ASP exchange gives its service thread and its training thread different
    # communicators (dup()), so a probe on one is never matched by a receive on another.

    def isend(self, buf: np.ndarray, dest: int, tag: int, op: str = "isend") -> SendHandle:
        """Start sending a uint8 buffer to `dest`; the handle keeps it alive until done.

        rank 0: c.isend(np.frombuffer(b"hi", np.uint8), dest=1, tag=7).wait()
        rank 1: c.recv(source=0, tag=7)  ->  (0, 7, array([104, 105], dtype=uint8))
        """
        self._count(op)
        buf = np.ascontiguousarray(buf, np.uint8)
        return SendHandle(self, self._comm.Isend([buf, _mpi().BYTE], dest, tag), buf, op, dest)

    def try_recv(self, source: int = -1, tag: int = -1):
        """A message that has arrived, if any: (source, tag, uint8 buffer), else None.
        source/tag -1 match any. Never blocks."""
        MPI = _mpi()
        status = MPI.Status()
        msg = self._comm.Improbe(MPI.ANY_SOURCE if source < 0 else source,
                                 MPI.ANY_TAG if tag < 0 else tag, status)
        if msg is None:
            return None
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        msg.Recv([buf, MPI.BYTE])
        return status.Get_source(), status.Get_tag(), buf

    def waiter(self, tag: int, source: int = -1, bell=None,
               shared: bool = False) -> "MessageWaiter | None":
        """A MessageWaiter for messages of `tag` (from `source`; -1: any) on this
        communicator, with doorbell `bell` (see MessageWaiter), or None where this MPI's
        MPI_Iprobe cannot be called from C (the caller polls with try_recv)."""
        MPI = _mpi()
        probe = _iprobe_address()
        size = MPI._sizeof(MPI.Comm)
        if probe is None or size not in (4, 8) or self._comm is None:
            return None
        return MessageWaiter(probe, size == 4, MPI._handleof(self._comm),
                             MPI.ANY_SOURCE if source < 0 else source, tag,
                             MPI._sizeof(MPI.Status), bell=bell, shared=shared)

    def recv(self, source: int = -1, tag: int = -1, op: str = "recv", timeout: float | None = None,
             poll=None, spin: float = 0.0):
        """Wait for a message (see _poll_until: back to back for `spin` seconds, then
        with back-off) and return it as try_recv does. After `timeout` (default: the
        communicator's) raises CommTimeoutError naming this rank, the peer and the
        operation. `poll`, if given, is called while waiting (e.g. to check that a
        helper thread is alive). A lost peer (elastic runs) is a PeerLostError."""
        try:
            return self._recv(source, tag, op, timeout, poll, spin)
        except _mpi().Exception as exc:
            raise self.lost(exc, op) from None

    def _recv(self, source, tag, op, timeout, poll, spin):
        got = self.try_recv(source, tag)
        if got is not None:
            return got
        self._count(op)
        limit = self.timeout if timeout is None else timeout
        box = []

        def ready():
            if poll is not None:
                poll()
            msg = self.try_recv(source, tag)
            if msg is not None:
                box.append(msg)
            return bool(box)

        who = "any rank" if source < 0 else f"rank {source}"

        before = paused()

        def message():
            head = (f"rank {self.rank}/{self.size}: {op}: no answer from {who} within "
                    f"{limit:g}s{_pause_note(paused() - before)}")
            lost, report = self.liveness(min(LIVENESS_GRACE, limit))
            if lost is None:
                report = f"{who} died, stopped serving or is cut off from rank {self.rank}"
            return f"{head}; {report} (raise the limit with {_TIMEOUT_VARS[self.kind]})"

        with self.waiting(op):
            _poll_until(ready, limit, message, spin=spin, idle=self.answer_liveness)
        return box[0]

    def alltoallv(self, send: np.ndarray, counts, op: str = "alltoallv",
                  recv_counts=None, header=None) -> AllToAllHandle:
        """Start a two-phase all-to-all: counts first, then the payload (one phase
        when the caller already knows `recv_counts`, e.g. replies to an earlier
        all-to-all: then it must be what the peers send, in the shape of counts, and
        the payload is posted at once).

        `send` holds rows (axis 0) grouped by destination rank. counts has shape
        (world,) or (world, k): counts[r].sum() rows go to rank r, split into k parts
        (e.g. one per table) that the receiver learns too. Empty splits are normal.
        `.wait()` returns (recv, recv_counts): rows grouped by source rank and
        recv_counts[s] = what rank s sent here (on one rank, recv is `send` itself).
        Example, 2 ranks, 1-D rows:

            rank 0: send=[1, 2, 3], counts=[1, 2]  ->  recv=[1, 7],    recv_counts=[1, 1]
            rank 1: send=[7, 8],    counts=[1, 1]  ->  recv=[2, 3, 8], recv_counts=[2, 1]

        header (int64, shape (m,)) rides along with the counts to every rank:
        `.headers()` waits for the counts only and returns every rank's header,
        (world, m), so the ranks can agree to go on (`.wait()`) or not (drop the
        handle: the payload is never posted). Only without recv_counts.

            rank 0: header=[1, 0]   rank 1: header=[0, 0]  ->  both: [[1, 0], [0, 0]]

        On a two-level topology (self.topology) it goes in two levels, inside each host
        and then across hosts, with the same results (TwoLevelHandle).
        """
        if self._two is not None:
            return TwoLevelHandle(self, send, counts, op, recv_counts, header)
        return AllToAllHandle(self, send, counts, op, recv_counts, header)

    def iallreduce(self, arr: np.ndarray, op: str = "allreduce") -> ReduceHandle:
        """Start an elementwise sum over all ranks (see allreduce); `.wait()` returns it.
        Another collective may be started before waiting for this one."""
        self._count(op)
        send = np.ascontiguousarray(arr)
        dt = _mpi_type(send.dtype)
        if self.size == 1:
            return ReduceHandle(self, None, send.copy(), op)
        recv = np.empty_like(send)
        return ReduceHandle(self, self._comm.Iallreduce([send, dt], [recv, dt], _mpi().SUM),
                            recv, op, send)


class ReduceHandle:
    """An allreduce in flight (Comm.iallreduce)."""

    def __init__(self, comm: Comm, req, recv: np.ndarray, op: str, send=None):
        self._c, self._req, self._recv, self._op, self._send = comm, req, recv, op, send

    def wait(self) -> np.ndarray:
        if self._req is not None:
            self._c.wait(self._req, self._op)
            self._req = self._send = None
        return self._recv


def _alltoallv_args(comm: Comm, send, counts, op: str, recv_counts, header):
    """An all-to-all's arguments checked (see Comm.alltoallv): (send, counts as given,
    counts (world, k), whether counts were 1-D, recv_counts or None, header or None).
    Raises CommError naming the rank, the operation and the mismatch."""
    send = np.ascontiguousarray(send)
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape[:1] != (comm.size,):
        raise CommError(f"rank {comm.rank}: {op}: counts must have one row per rank "
                        f"({comm.size}), got shape {counts.shape}")
    send_counts = np.ascontiguousarray(counts.reshape(comm.size, -1))
    if int(send_counts.sum()) != send.shape[0]:
        raise CommError(f"rank {comm.rank}: {op}: counts sum to "
                        f"{int(send_counts.sum())} but send has {send.shape[0]} rows")
    known = None if recv_counts is None else np.asarray(recv_counts, dtype=np.int64)
    if known is not None and known.shape != counts.shape:
        raise CommError(f"rank {comm.rank}: {op}: recv_counts must have the shape of "
                        f"counts {counts.shape}, got {known.shape}")
    hdr = None if header is None else np.ascontiguousarray(header, np.int64).reshape(-1)
    if hdr is not None and known is not None:
        raise CommError(f"rank {comm.rank}: {op}: a header needs the counts phase "
                        "(no recv_counts)")
    _mpi_type(send.dtype)
    return send, counts, send_counts, counts.ndim == 1, known, hdr


class _TwoLevel:
    """A communicator's two-level exchange (kvcoll._topology): its two sub-communicators,
    made with it and freed with it, and its all-to-alls in flight.

    intra: the ranks of this rank's host (rank = local rank l); inter: the ranks of this
    rank's local rank on every host (rank = host index h). On both, an all-to-all is
    point-to-point messages with tags of its own (a sequence number per all-to-all), not
    an MPI collective: its stages are posted as earlier ones complete, and an
    all-to-all that one rank waits for while another waits in something else (the push's
    gradients, waited before or after the step's allreduce by rank) must still progress
    in any order; every wait on the communicator advances them all (`progress`)."""

    _TAGS = 4096   # all-to-alls whose tags may be in use at once (4 tags each)

    def __init__(self, comm: Comm):
        topo = comm.topology
        self.grid = topo.grid
        self.hosts, self.per_host = topo.hosts, topo.per_host
        self.h, self.l = topo.where(comm.rank)
        self.order1 = level1_order(self.grid)
        self.order2 = level2_order(self.hosts, self.per_host)
        self.order3 = source_order(self.grid)
        self.intra = self.inter = None
        self.seq = 0
        self.inflight: list = []
        self.intra = comm._split(self.h, self.l, "topology:split-by-host")
        try:
            self.inter = comm._split(self.l, self.h, "topology:split-by-local-rank")
        except BaseException:
            self.free()
            raise
        got = (self.intra.Get_size(), self.intra.Get_rank(), self.inter.Get_size(),
               self.inter.Get_rank())
        if got != (self.per_host, self.l, self.hosts, self.h):  # pragma: no cover - MPI bug
            self.free()
            raise CommError(f"rank {comm.rank}: the exchange's sub-communicators came out "
                            f"as (size, rank) {got[:2]} and {got[2:]}, expected "
                            f"{(self.per_host, self.l)} and {(self.hosts, self.h)}")

    def next_tag(self) -> int:
        tag = (self.seq % self._TAGS) * 4
        self.seq += 1
        return tag

    def progress(self) -> None:
        """Advance every all-to-all in flight as far as it goes without waiting."""
        for handle in list(self.inflight):
            if handle._advance():
                self.inflight.remove(handle)

    def revoke(self) -> None:
        for c in (self.intra, self.inter):
            if c is not None:
                try:
                    if not c.Is_revoked():
                        c.Revoke()
                except (_mpi().Exception, AttributeError, NotImplementedError):
                    pass

    def free(self) -> None:
        """Free the sub-communicators (local; after a loss too: a revoked one may be
        freed)."""
        self.inflight.clear()
        for name in ("intra", "inter"):
            c = getattr(self, name)
            setattr(self, name, None)
            if c is not None:
                try:
                    c.Free()
                except _mpi().Exception:  # pragma: no cover - a communicator of a lost world
                    pass


class _Reached:
    """What Comm.wait tests for a two-level all-to-all: advance it, then whether it has
    reached `stage`."""

    def __init__(self, handle: TwoLevelHandle, stage: int):
        self.handle, self.stage = handle, stage

    def Test(self) -> bool:
        self.handle._advance()
        return self.handle._stage >= self.stage


class TwoLevelHandle:
    """A two-level all-to-all in flight (see kvcoll._topology and _TwoLevel): what
    Comm.alltoallv returns when the communicator's topology is two-level, with the
    interface and the results of AllToAllHandle (`headers()`, `wait()`), bit for bit.

    Stages: the counts inside the host (posted at creation), the counts across hosts
    (with every rank's header; skipped when the receive counts are known), then, once
    the caller waits (at once when the receive counts are known), the payload inside the
    host and the payload across hosts. Each stage is one message to each other rank of a
    sub-communicator; an empty payload message is not sent (both sides know its size)."""

    COUNTS1, COUNTS2, COUNTED, PAYLOAD1, PAYLOAD2, DONE = range(6)

    def __init__(self, comm: Comm, send: np.ndarray, counts, op: str, recv_counts=None,
                 header=None):
        self._c, self._op = comm, op
        two = comm._two
        self._t = two
        self._send, _, self._send_counts, self._flat, known, hdr = \
            _alltoallv_args(comm, send, counts, op, recv_counts, header)
        comm._count(op)
        self._k = self._send_counts.shape[1]
        self._hdr = hdr
        self._known = None if known is None else known.reshape(comm.size, -1)
        self._go = known is not None           # the payload may go (see wait())
        self._tag = two.next_tag()
        self._reqs: list = []                  # the current stage's requests
        self._keep: list = []                  # buffers MPI reads or writes meanwhile
        self._result = None
        self._headers = None
        self._recv_counts = None
        self._stage = self.COUNTS1
        self._post_counts1()
        two.inflight.append(self)

    # -- the stages -------------------------------------------------------------------

    def _exchange(self, comm, me: int, send, send_rows, recv, recv_rows, tag: int,
                  skip_empty: bool) -> list:
        """One message of send's rows to each rank of `comm` (send_rows[p] rows for rank
        p, one block after another) and one from each into recv (recv_rows[p]); this
        rank's own block is copied. Returns the requests."""
        dt = _mpi_type(send.dtype)
        sd = np.zeros(len(send_rows) + 1, np.int64)
        np.cumsum(send_rows, out=sd[1:])
        rd = np.zeros(len(recv_rows) + 1, np.int64)
        np.cumsum(recv_rows, out=rd[1:])
        reqs = []
        sent = 0
        for p in range(len(send_rows)):
            if p == me:
                recv[rd[p]:rd[p + 1]] = send[sd[p]:sd[p + 1]]
                continue
            if recv_rows[p] or not skip_empty:
                reqs.append(comm.Irecv([recv[rd[p]:rd[p + 1]], dt], p, tag))
            if send_rows[p] or not skip_empty:
                reqs.append(comm.Isend([send[sd[p]:sd[p + 1]], dt], p, tag))
                sent += 1
        self._keep += [send, recv]
        self._c._sent(self._op, sent)
        return reqs

    def _post_counts1(self) -> None:
        t, k = self._t, self._k
        H, L = t.hosts, t.per_host
        m = 0 if self._hdr is None else self._hdr.size
        msg = np.empty((L, H * k + m), np.int64)
        msg[:, :H * k] = self._send_counts[t.grid.T].reshape(L, H * k)
        if m:
            msg[:, H * k:] = self._hdr
        self._rc1 = np.empty_like(msg)
        self._reqs = self._exchange(t.intra, t.l, msg, np.ones(L, np.int64), self._rc1,
                                    np.ones(L, np.int64), self._tag, False)

    def _counts1_in(self) -> None:
        t, k = self._t, self._k
        H, L = t.hosts, t.per_host
        rc1 = self._rc1
        self._c1 = np.ascontiguousarray(rc1[:, :H * k]).reshape(L, H, k)  # (h,l)->(h',me.l)
        self._c1rows = self._c1.sum(axis=2)
        if self._known is not None:
            self._counted(self._known[t.grid], None)
            return
        m = rc1.shape[1] - H * k
        msg = np.empty((H, L * k + L * m), np.int64)
        msg[:, :L * k] = self._c1.transpose(1, 0, 2).reshape(H, L * k)
        if m:
            msg[:, L * k:] = rc1[:, H * k:].reshape(1, L * m)
        self._rc2 = np.empty_like(msg)
        self._reqs = self._exchange(t.inter, t.h, msg, np.ones(H, np.int64), self._rc2,
                                    np.ones(H, np.int64), self._tag + 1, False)
        self._stage = self.COUNTS2

    def _counts2_in(self) -> None:
        t, k = self._t, self._k
        H, L = t.hosts, t.per_host
        rc2 = self._rc2
        c2 = np.ascontiguousarray(rc2[:, :L * k]).reshape(H, L, k)   # (h, l) -> this rank
        m = (rc2.shape[1] - L * k) // L
        hdr = np.ascontiguousarray(rc2[:, L * k:]).reshape(H, L, m) if m else None
        self._counted(c2, hdr)

    def _counted(self, c2: np.ndarray, hdr) -> None:
        """The counts are in: c2[h, l] = what rank grid[h, l] sends here."""
        t = self._t
        P = self._c.size
        at = t.grid.reshape(-1)
        self._c2rows = c2.sum(axis=2)
        if self._known is not None:
            self._recv_counts = self._known
        else:
            rc = np.empty((P, self._k), np.int64)
            rc[at] = c2.reshape(P, self._k)
            self._recv_counts = rc
        if hdr is not None:
            heads = np.empty((P, hdr.shape[2]), np.int64)
            heads[at] = hdr.reshape(P, -1)
            self._headers = heads
        self._rc1 = self._rc2 = None
        self._keep = []
        self._stage = self.COUNTED

    def _post_payload1(self) -> None:
        t = self._t
        send, shape = self._send, self._send.shape[1:]
        rows = self._send_counts.sum(axis=1)
        s1 = permute_blocks(send, rows, t.order1)
        r1 = np.empty((int(self._c1rows.sum()),) + shape, send.dtype)
        self._r1 = r1
        self._reqs = self._exchange(t.intra, t.l, s1, rows[t.grid.T].sum(axis=1), r1,
                                    self._c1rows.sum(axis=1), self._tag + 2, True)
        n2 = int(self._c2rows.sum())
        # the last stage's buffer is the result when no reorder follows: aligned
        r2 = (aligned_empty(n2 * int(np.prod(shape, dtype=np.int64)), send.dtype)
              .reshape((n2,) + shape) if t.order3 is None else np.empty((n2,) + shape, send.dtype))
        self._r2 = r2
        self._stage = self.PAYLOAD1

    def _post_payload2(self) -> None:
        t = self._t
        s2 = permute_blocks(self._r1, self._c1rows.reshape(-1), t.order2)
        self._r1 = None
        self._reqs = self._exchange(t.inter, t.h, s2, self._c1rows.sum(axis=0), self._r2,
                                    self._c2rows.sum(axis=1), self._tag + 3, True)
        self._stage = self.PAYLOAD2

    def _finish(self) -> None:
        t = self._t
        r2, self._r2 = self._r2, None
        if t.order3 is None:
            recv = r2
        else:
            width = int(np.prod(r2.shape[1:], dtype=np.int64))
            recv = aligned_empty(r2.shape[0] * width, r2.dtype).reshape(r2.shape)
            permute_blocks(r2, self._c2rows.reshape(-1), t.order3, out=recv)
        counts = self._recv_counts[:, 0] if self._flat else self._recv_counts
        self._result = (recv, counts)
        self._keep = []
        self._send = None
        self._stage = self.DONE

    def _advance(self) -> bool:
        """Go on as far as possible without waiting; True when nothing more happens
        until the caller acts (done, or counted and not yet waited for)."""
        while True:
            if self._reqs:
                # one Test per request, not Testall: a lost peer's error then comes as
                # its own class (MPI_ERR_PROC_FAILED, _REVOKED), which Comm.lost knows,
                # not as MPI_ERR_IN_STATUS
                self._reqs = [r for r in self._reqs if not r.Test()]
                if self._reqs:
                    return False
            stage = self._stage
            if stage == self.COUNTS1:
                self._counts1_in()
            elif stage == self.COUNTS2:
                self._counts2_in()
            elif stage == self.COUNTED:
                if not self._go:
                    return True
                self._post_payload1()
            elif stage == self.PAYLOAD1:
                self._post_payload2()
            elif stage == self.PAYLOAD2:
                self._finish()
            else:
                return True

    # -- the interface of AllToAllHandle ------------------------------------------------

    def headers(self) -> np.ndarray:
        """Every rank's header, (world, m), once the counts are in (see Comm.alltoallv)."""
        self._c.wait(_Reached(self, self.COUNTED), self._op + ":counts")
        if self._headers is None:
            raise CommError(f"rank {self._c.rank}: {self._op}: no header was sent")
        return self._headers

    def wait(self):
        if self._result is None:
            self._go = True
            if self not in self._t.inflight:
                self._t.inflight.append(self)
            self._c.wait(_Reached(self, self.DONE), self._op)
        return self._result


class AllToAllHandle:
    """An all-to-all in flight; `wait()` finishes it. The counts exchange (unless the
    receive counts are known) is posted at creation, the payload as soon as the counts
    are in (at once when they are known)."""

    def __init__(self, comm: Comm, send: np.ndarray, counts, op: str, recv_counts=None,
                 header=None):
        self._c = comm
        self._op = op
        self._send, counts, self._send_counts, self._flat, known, hdr = \
            _alltoallv_args(comm, send, counts, op, recv_counts, header)
        comm._count(op)
        self._result = None
        self._req = None
        self._payload = None
        self._headers = None
        if comm.size == 1:  # one rank sends everything to itself (no MPI call)
            self._result = (self._send, counts.copy())
            self._headers = None if hdr is None else hdr[None].copy()
            return
        if known is not None:
            self._recv_counts = np.ascontiguousarray(known.reshape(comm.size, -1))
            self._post_payload()
            return
        k = self._send_counts.shape[1]
        sc = self._send_counts
        if hdr is not None:  # the header: extra columns, the same to every rank
            sc = np.concatenate([sc, np.broadcast_to(hdr, (comm.size, hdr.size))], axis=1)
        self._hdr_cols = 0 if hdr is None else hdr.size
        self._send_all = np.ascontiguousarray(sc)  # MPI reads it until the counts are in
        self._recv_all = np.empty_like(self._send_all)
        self._recv_counts = self._recv_all[:, :k]
        MPI = _mpi()
        w = sc.shape[1]
        self._req = comm._comm.Ialltoall([self._send_all, w, MPI.INT64_T],
                                         [self._recv_all, w, MPI.INT64_T])
        comm._sent(op, comm.size - 1)

    def _counts_in(self) -> None:
        if self._req is not None:
            self._c.wait(self._req, self._op + ":counts")
            self._req = self._send_all = None
            k = self._send_counts.shape[1]
            self._recv_counts = np.ascontiguousarray(self._recv_all[:, :k])
            if self._hdr_cols:
                self._headers = np.ascontiguousarray(self._recv_all[:, k:])

    def headers(self) -> np.ndarray:
        """Every rank's header, (world, m), once the counts are in (see alltoallv)."""
        self._counts_in()
        if self._headers is None:
            raise CommError(f"rank {self._c.rank}: {self._op}: no header was sent")
        return self._headers

    def _post_payload(self) -> None:
        c = self._c
        width = int(np.prod(self._send.shape[1:], dtype=np.int64))
        recv_rows = self._recv_counts.sum(axis=1)
        # 64-byte aligned: received rows go to TensorFlow without a copy
        recv = aligned_empty(int(recv_rows.sum()) * width, self._send.dtype).reshape(
            (int(recv_rows.sum()),) + self._send.shape[1:])
        sc = self._send_counts.sum(axis=1) * width
        rc = recv_rows * width
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(np.int64)
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(np.int64)
        dt = _mpi_type(self._send.dtype)
        send = self._send if self._send.size else np.zeros(1, self._send.dtype)
        rbuf = recv if recv.size else np.zeros(1, recv.dtype)
        req = c._comm.Ialltoallv([send, (sc, sd), dt], [rbuf, (rc, rd), dt])
        c._sent(self._op, c.size - 1)
        # MPI reads and writes these until the request completes: keep them alive
        self._payload = (req, recv, (send, rbuf, sc, sd, rc, rd))

    def wait(self):
        if self._result is not None:
            return self._result
        self._counts_in()
        if self._payload is None:
            self._post_payload()
        req, recv, _ = self._payload
        self._c.wait(req, self._op)
        counts = self._recv_counts[:, 0] if self._flat else self._recv_counts
        self._result = (recv, counts)
        self._payload = None
        return self._result


class SendHandle:
    """A point-to-point send in flight (see Comm.isend)."""

    def __init__(self, comm: Comm, req, buf: np.ndarray, op: str, dest: int):
        self._c, self._req, self._buf, self.op, self.dest = comm, req, buf, op, dest

    def done(self) -> bool:
        if self._req is None:
            return True
        try:
            finished = self._req.Test()
        except _mpi().Exception as exc:
            raise self._c.lost(exc, self.op) from None
        if finished:
            self._req, self._buf = None, None
            return True
        return False

    def wait(self) -> None:
        if self._req is not None:
            self._c.wait(self._req, self.op, peer=self.dest)
            self._req, self._buf = None, None


_IPROBE: list = []    # [MPI_Iprobe's address or None], looked up once


def _iprobe_address() -> int | None:
    """The address of the MPI_Iprobe of the MPI mpi4py runs on (found through mpi4py's
    own extension, whose dependencies hold it), or None."""
    if not _IPROBE:
        import ctypes
        try:
            lib = ctypes.CDLL(_mpi().__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            _IPROBE.append(ctypes.cast(lib.MPI_Iprobe, ctypes.c_void_p).value)
        except (OSError, AttributeError):
            _IPROBE.append(None)
    return _IPROBE[0]


class MessageWaiter:
    """Waits in C, with the GIL released, until a message may be received on a Comm,
    until its doorbell rings, or until a budget runs out (csrc/kv_poll.h: MPI_Iprobe,
    then pauses of `first` seconds doubling to `most`, which a ring ends at once); see
    Comm.waiter. The SSP/ASP service thread idles in it. wait() returns whether to look
    now (a message, a ring, or an MPI error, which the caller's own receive then raises
    with the rank and the operation).

    bell: the doorbell, a cffi `int32_t *` (shared: in memory other processes map and
    ring, kvcoll.exchange.doorbell); default a word of this process's own. ring() rings
    it from any thread of this process."""

    def __init__(self, probe: int, int_handle: bool, handle: int, source: int, tag: int,
                 status_size: int, bell=None, shared: bool = False, first: float = 20e-6,
                 most: float = 1e-3):
        from ._c import ffi, lib
        self._lib = lib
        self._probe = ffi.cast("void *", probe)
        self._args = (int(int_handle), handle, source, tag)
        self._status = ffi.new("char[]", max(64, status_size))
        self._bell = bell if bell is not None else ffi.new("int32_t *")
        self._shared = int(bool(shared and bell is not None))
        self._first, self._most = int(first * 1e9), int(most * 1e9)

    def wait(self, budget: float) -> bool:
        """Wait at most `budget` seconds; True: look now (see the class)."""
        lib = self._lib
        return lib.kv_poll_wait(self._probe, *self._args, self._status, self._first,
                                self._most, int(budget * 1e9), self._bell,
                                self._shared) != lib.KV_POLL_IDLE

    def ring(self) -> None:
        """End a wait now (or the next one, at once)."""
        self._lib.kv_poll_ring(self._bell, self._shared)


class _ParentAbort:
    """What install_abort_hook needs of a Comm, for the parent communicator of one that
    could not be made."""

    def __init__(self, parent):
        self._parent, self.rank, self.size = parent, parent.Get_rank(), parent.Get_size()

    def abort(self, code: int = 1) -> None:
        self._parent.Abort(code)


def announce(event: dict) -> None:
    """Tell the elastic launcher (launch/kvcollrun --elastic) what happened: one line
    `kvcoll-elastic {json}` on stderr (mpirun tags it with the rank)."""
    sys.stderr.write("kvcoll-elastic " + json.dumps(event, sort_keys=True) + "\n")
    sys.stderr.flush()


_ABORT = {"comm": None}     # the communicator an uncaught exception aborts (the latest)


def _mpi_error_text(exc) -> str:
    """An MPI error as a log line names it: its error class and Open MPI's text."""
    try:
        return f"MPI error class {exc.Get_error_class()} ({exc.Get_error_string()})"
    except Exception:  # noqa: BLE001 - not an MPI error object
        return str(exc)


def _peer_lost(exc) -> bool:
    """Whether `exc` (or what it was raised from) is a lost peer: a PeerLostError, or
    an MPI error of ULFM's (a service thread's own MPI call may raise it as it is)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, PeerLostError) or any(
                m in str(exc) for m in ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED")):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def install_abort_hook(comm: Comm) -> None:
    """Make an uncaught exception on any rank, in any thread, end the whole job instead
    of leaving the other ranks waiting in a collective. Called again with a new
    communicator (an elastic run's survivors), it aborts that one instead."""
    installed = _ABORT["comm"] is not None
    _ABORT["comm"] = comm
    if comm.size <= 1 or installed:
        return
    previous, previous_thread = sys.excepthook, threading.excepthook

    def abort(kind, where, value=None):
        comm = _ABORT["comm"]
        if getattr(comm, "elastic", False) and _peer_lost(value):
            ranks = value.ranks if isinstance(value, PeerLostError) else comm.failed_ranks()
            peers = comm.peers
            announce({"event": "lost", "mode": "relaunch", "ranks": ranks,
                      "hosts": sorted({peers[r]["host"] for r in ranks if r < len(peers)})})
        sys.stderr.write(f"kvcoll: rank {comm.rank} raised {kind.__name__}{where}; "
                         "aborting the job\n")
        sys.stderr.flush()
        # MPI_Abort asks the launcher to end every rank; when the launcher cannot be
        # reached (this host is cut off) it may never return: exit anyway (faulthandler's
        # watchdog is a C thread, it needs no GIL; it prints every thread's stack first).
        faulthandler.dump_traceback_later(ABORT_EXIT_AFTER, exit=True)
        comm.abort(1)

    def hook(kind, value, tb):
        previous(kind, value, tb)
        abort(kind, "", value)

    def thread_hook(args):
        previous_thread(args)
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "?"
            abort(args.exc_type, f" in thread {name!r}", args.exc_value)

    sys.excepthook = hook
    threading.excepthook = thread_hook
