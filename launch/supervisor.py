"""kvcollrun's elastic mode: run a kvcoll job on the hosts there are, and when the job
cannot carry on by itself, relaunch it on the hosts that are left, from its latest
checkpoint.

    launch/kvcollrun --elastic --min-np 2 --max-np 8 --host-discovery-script ./discover.sh \\
        python train.py --checkpoint-dir /shared/ck ...
    launch/kvcollrun --elastic --min-np 2 --hostfile hosts python train.py ...

Hosts come from a discovery script (Horovod's flag and format: one `host:slots` line per
host, `host` alone for one slot; run at the start and before every relaunch), a
hostfile (`host slots=N` lines) or -H/--host (`a:2,b:2`); with none of them, this host
alone. The job gets min(--max-np, -np if given, the hosts' slots) ranks, at least
--min-np.

Every launch runs mpirun with Open MPI's fault tolerance (`--with-ft ulfm`) and
KVCOLL_ELASTIC_MIN_NP set, so kv.init() is elastic: a rank that dies, is stopped or is
cut off does not end the job; the survivors shrink to a communicator of their own and
continue in memory (kvcoll.elastic), or, below --min-np, save what they hold and exit
non-zero with the reason. A dead process is reported by Open MPI's runtime within a
second; a stopped one, or one whose host is cut off, by ULFM's heartbeat detector,
which kvcollrun turns on (its own thread in every rank, so a rank busy computing,
tracing or writing a checkpoint still beats): --heartbeat-period (default 0.5 s) and
--heartbeat-timeout (default 2.5 s, more than 3 periods); its findings reach every
rank by reliable broadcast (mpi_ft_propagator_with_rbcast). The runtime's daemons watch
each other with TCP keepalives (2 s idle, then 5 probes 1 s apart: Open MPI's defaults
take minutes), so a lost host ends the job in about 7 s, not minutes, after the
survivors have saved what they hold (see below). mpirun options given on the command
line (or as OMPI_MCA_/PRTE_MCA_ variables) win.

When the survivors went on without a rank, kvcollrun makes sure its process is gone:
it kills it on its host through the same agent mpirun starts daemons with (ssh, or
srun in a SLURM allocation), by the pid the survivors reported (a stopped process
would otherwise stay; one on a host cut off fences itself: it exits once it finds
itself outside the survivors' majority). Some failures end the whole job anyway (the runtime daemon of
a lost host takes every rank with it in Open MPI 5.0; a failure outside a training
step): then kvcollrun relaunches the job on the hosts that are left, which restores the
latest checkpoint (kv.callbacks.Checkpoint(restore=True)) resharded onto the new world,
and says so. So does a launch whose kv.init failed on a peer lost or missing before
anything began (kvcoll tells it: a `start_failed` event), or whose Open MPI start-up
failed (a rank's crash inside MPI_Init, which ULFM's start-up did in 1-4% of elastic
launches on a busy host before kv.init guarded against its cause, or a PMIx server
that did not start). Hosts that lost a rank are
held out for --cooldown seconds (default 60),
not for the rest of the job. It stops relaunching after --max-relaunches (default 10),
when fewer than --min-np slots are left for --elastic-timeout seconds (default 60),
when a rank failed with an ordinary error (a bug does not go away by relaunching), or
when kvcollrun itself was signalled. Losing this host (where mpirun runs) ends the job.

Growing back. While a job runs, kvcollrun runs the discovery script (or reads the
hostfile) again every --discovery-interval seconds (default 10). When more slots are
usable than the job has (hosts back from their cooldown, or new ones), up to --max-np,
it asks the job to stop after its next step and save (SIGUSR2, as for a preemption:
model.fit stops every rank after the same step and kv.callbacks.Checkpoint saves), then
relaunches it on the larger world, which restores that checkpoint resharded (each new
rank reads the buckets the even map gives it).

The ranks tell kvcollrun what happened in lines `kvcoll-elastic {json}` (kvcoll.elastic
writes them): {"event": "lost", "ranks": [...], "hosts": [...], ...} when the survivors
went on without some ranks, {"event": "below_min_np", ...} when they saved and stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

EVENT = re.compile(r"kvcoll-elastic (\{.*\})")
# mpirun's own reports of a lost rank or daemon, naming its host ("on node X"; in the
# report of a daemon that died or could not be reached: "Remote host: X")
LOST_ON_NODE = re.compile(r"(?:exited on signal|killed|Remote daemon).*?\bon node "
                          r"(\S+?)[\s,.:]|^\s*Remote host:\s+(\S+)", re.IGNORECASE)
# a rank that raised an ordinary error (not a lost peer): kvcoll's abort line
RAISED = re.compile(r"kvcoll: rank \d+ raised (\S+?)(?: in thread .*)?; aborting the job")
# a rank that crashed (Open MPI's signal handler) or called MPI_Abort
CRASHED = re.compile(r"\*\*\* Process received signal \*\*\*|MPI_ABORT was invoked")
# Open MPI's own start-up failed: a rank's crash backtrace inside MPI_Init (ULFM: the
# failure notice of another rank reaches a communicator not made yet), or the runtime's
# PMIx server did not start. Nothing of the program ran: starting again is safe.
MPI_START_FAILED = re.compile(r"\((?:ompi_mpi_init|PMPI_Init(?:_thread)?)\+0x"
                              r"|PMIx server's listener thread failed to start")
PEER_ERRORS = ("PeerLostError",)

DISCOVERY_TIMEOUT = 30.0     # seconds a discovery script may run
RELAUNCH_PAUSE = 1.0         # seconds between a job's end and its relaunch (its runtime's
                             # files and ports go: a relaunch at once crashed now and then)
REACH_TIMEOUT = 20.0         # seconds a host's reachability check may take
HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


class LaunchError(Exception):
    """Bad launcher input or a job that cannot be (re)launched: the message says what and
    how to fix it."""


@dataclasses.dataclass
class Options:
    """kvcollrun's elastic flags (the rest of the command line goes to mpirun)."""

    min_np: int = 1
    max_np: int | None = None
    np: int | None = None
    discovery: str | None = None
    hostfile: str | None = None
    host_list: str | None = None
    cooldown: float = 60.0
    max_relaunches: int = 10
    elastic_timeout: float = 60.0
    heartbeat_period: float = 0.5
    heartbeat_timeout: float = 2.5
    discovery_interval: float = 10.0


_INT_FLAGS = {"--min-np": "min_np", "--max-np": "max_np", "--max-relaunches": "max_relaunches",
              "-np": "np", "-n": "np", "--np": "np", "-c": "np"}
_FLOAT_FLAGS = {"--cooldown": "cooldown", "--elastic-timeout": "elastic_timeout",
                "--heartbeat-period": "heartbeat_period",
                "--heartbeat-timeout": "heartbeat_timeout",
                "--discovery-interval": "discovery_interval"}
_STR_FLAGS = {"--host-discovery-script": "discovery", "--hostfile": "hostfile",
              "-hostfile": "hostfile", "--machinefile": "hostfile",
              "-machinefile": "hostfile", "-H": "host_list", "--host": "host_list",
              "-host": "host_list"}


def split_args(argv: list, takes_one: set, takes_two: set) -> tuple[Options, list, list]:
    """(elastic options, the other mpirun options, the program and its arguments) of
    kvcollrun's command line after --elastic (which may appear anywhere before the
    program). takes_one/takes_two: mpirun's flags that take one or two values."""
    opts, rest, i = Options(), [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "--":
            break
        name, eq, value = arg.partition("=")
        known = name in _INT_FLAGS or name in _FLOAT_FLAGS or name in _STR_FLAGS
        if name == "--elastic":
            i += 1
            continue
        if known:
            if not eq:
                if i + 1 >= len(argv):
                    raise LaunchError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            if name in _INT_FLAGS:
                setattr(opts, _INT_FLAGS[name], _number(name, value, int))
            elif name in _FLOAT_FLAGS:
                setattr(opts, _FLOAT_FLAGS[name], _number(name, value, float))
            else:
                setattr(opts, _STR_FLAGS[name], value)
            i += 1
            continue
        rest.append(arg)
        if not eq and name in takes_two:
            rest += argv[i + 1:i + 3]
            i += 2
        elif not eq and name in takes_one:
            rest += argv[i + 1:i + 2]
            i += 1
        i += 1
    program = argv[i:]
    if program[:1] == ["--"]:
        program = program[1:]
    check(opts, program)
    return opts, rest, program


def _number(flag: str, value: str, kind):
    try:
        return kind(value)
    except ValueError:
        raise LaunchError(f"{flag} must be a{'n integer' if kind is int else ' number'}, "
                          f"got {value!r}") from None


def check(o: Options, program: list) -> None:
    """The elastic options make sense together (else LaunchError naming the problem)."""
    if not program:
        raise LaunchError("no program to run: launch/kvcollrun --elastic --min-np N ... "
                          "python train.py")
    if o.min_np < 1:
        raise LaunchError(f"--min-np must be >= 1, got {o.min_np}")
    if o.max_np is not None and o.max_np < o.min_np:
        raise LaunchError(f"--min-np {o.min_np} is more than --max-np {o.max_np}: the job "
                          "could never run; lower --min-np or raise --max-np")
    if o.np is not None and (o.np < o.min_np or (o.max_np is not None and o.np > o.max_np)):
        raise LaunchError(f"-np {o.np} is outside [--min-np {o.min_np}, --max-np "
                          f"{o.max_np if o.max_np is not None else 'unbounded'}]")
    if sum(x is not None for x in (o.discovery, o.hostfile, o.host_list)) > 1:
        raise LaunchError("give the hosts one way: --host-discovery-script, --hostfile or -H")
    if not o.discovery_interval > 0:
        raise LaunchError(f"--discovery-interval must be > 0 seconds, got "
                          f"{o.discovery_interval:g}")
    if o.cooldown < 0 or o.elastic_timeout < 0 or o.max_relaunches < 0:
        raise LaunchError("--cooldown, --elastic-timeout and --max-relaunches must be >= 0")
    if not o.heartbeat_period > 0 or not o.heartbeat_timeout > 3 * o.heartbeat_period:
        raise LaunchError(f"--heartbeat-timeout {o.heartbeat_timeout:g} must be more than 3 "
                          f"--heartbeat-period ({o.heartbeat_period:g} s, > 0): a rank is "
                          "declared lost only after several missed beats")


# -- hosts -----------------------------------------------------------------------------

def parse_slots(text: str, source: str, style: str) -> dict:
    """{host: slots} from a discovery script's output (style "discovery": `host:slots`
    or `host` per line) or a hostfile (style "hostfile": `host [slots=N]`); LaunchError
    naming the line that is not one. Blank lines and # comments are skipped."""
    hosts: dict = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if style == "discovery":
            m = re.fullmatch(r"([^\s:]+)(?::(\d+))?", line)
            host, slots = (m.group(1), m.group(2)) if m else (None, None)
        else:
            m = re.fullmatch(r"(\S+)((?:\s+\S+=\S+)*)", line)
            host, slots = (m.group(1), None) if m else (None, None)
            if m:
                for kv in m.group(2).split():
                    key, _, value = kv.partition("=")
                    if key == "slots":
                        slots = value
        if host is None or not HOST_RE.match(host) or (slots is not None and
                                                       not slots.isdigit()):
            want = "host:slots or host" if style == "discovery" else "host [slots=N]"
            raise LaunchError(f"{source}, line {n}: {raw.strip()!r} is not `{want}`")
        count = int(slots) if slots is not None else 1
        if count < 1:
            raise LaunchError(f"{source}, line {n}: {raw.strip()!r}: slots must be >= 1")
        hosts[host] = hosts.get(host, 0) + count
    return hosts


def parse_host_list(text: str) -> dict:
    """-H a:2,b:2,c -> {"a": 2, "b": 2, "c": 1}."""
    return parse_slots("\n".join(text.split(",")), f"-H {text!r}", "discovery")


def discover(o: Options) -> dict | None:
    """{host: slots} as the options give them now; None: this host alone (no host flag)."""
    if o.discovery:
        script = o.discovery
        if not os.path.isfile(script) or not os.access(script, os.X_OK):
            raise LaunchError(f"--host-discovery-script {script}: not an executable file "
                              f"(chmod +x it, or give its path)")
        try:
            done = subprocess.run([os.path.abspath(script)], capture_output=True, text=True,
                                  timeout=DISCOVERY_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"--host-discovery-script {script} did not finish within "
                              f"{DISCOVERY_TIMEOUT:g}s") from None
        except OSError as exc:
            raise LaunchError(f"--host-discovery-script {script} cannot run: {exc}") from None
        if done.returncode != 0:
            raise LaunchError(f"--host-discovery-script {script} failed with exit code "
                              f"{done.returncode}: {done.stderr.strip()[-500:] or '(no output)'}")
        hosts = parse_slots(done.stdout, f"--host-discovery-script {script}", "discovery")
        if not hosts:
            raise LaunchError(f"--host-discovery-script {script} printed no host (it must "
                              "print one `host:slots` line per host)")
        return hosts
    if o.hostfile:
        try:
            with open(o.hostfile) as f:
                text = f.read()
        except OSError as exc:
            raise LaunchError(f"--hostfile {o.hostfile}: {exc}") from None
        hosts = parse_slots(text, f"--hostfile {o.hostfile}", "hostfile")
        if not hosts:
            raise LaunchError(f"--hostfile {o.hostfile} names no host")
        return hosts
    if o.host_list:
        return parse_host_list(o.host_list)
    for var in ("PRTE_MCA_prte_default_hostfile", "OMPI_MCA_orte_default_hostfile"):
        if os.environ.get(var):     # (the Kubeflow MPI operator's)
            return discover(Options(hostfile=os.environ[var]))
    return None


def _is_here(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn())


def ssh_agent(mpi_opts: list) -> list:
    """The command that reaches a host as mpirun does: srun in a SLURM allocation (mpirun
    starts its daemons with it), else plm_ssh_agent (default ssh)."""
    if os.environ.get("SLURM_JOB_ID"):
        return ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--time=1", "-w"]
    agent = None
    for i, a in enumerate(mpi_opts):
        if a in ("--prtemca", "--mca", "-mca") and i + 2 < len(mpi_opts) + 1 and \
                mpi_opts[i + 1:i + 2] in (["plm_ssh_agent"], ["plm_rsh_agent"]):
            agent = mpi_opts[i + 2]
    agent = agent or os.environ.get("PRTE_MCA_plm_ssh_agent") or "ssh"
    first = shlex.split(agent.split(":")[0])
    if os.path.basename(first[0]) == "ssh":
        first += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(REACH_TIMEOUT / 2)}"]
    return first


def unreachable(hosts, agent: list, timeout: float = REACH_TIMEOUT) -> dict:
    """{host: why} for the hosts mpirun could not start a daemon on: `AGENT host true`
    fails or outlives `timeout` (this host is not checked). Checked in parallel."""
    procs = {}
    for h in hosts:
        if _is_here(h):
            continue
        try:
            procs[h] = subprocess.Popen([*agent, h, "true"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            return {h: f"{' '.join(agent)} cannot run: {exc}"}
    deadline, bad = time.monotonic() + timeout, {}
    for h, p in procs.items():
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            bad[h] = f"`{' '.join(agent)} {h} true` did not answer within {timeout:g}s"
            continue
        if p.returncode != 0:
            bad[h] = (f"`{' '.join(agent)} {h} true` exited with {p.returncode}: "
                      f"{err.strip()[-300:] or '(no output)'}")
    return bad


@dataclasses.dataclass
class Outcome:
    """What one launch's output said: the hosts and ranks lost, whether the survivors
    stopped below --min-np, the errors ranks raised, how many ranks ended normally."""

    lost_hosts: set = dataclasses.field(default_factory=set)
    lost_ranks: int = 0
    below_min: str | None = None
    raised: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    killed: set = dataclasses.field(default_factory=set)
    kills: list = dataclasses.field(default_factory=list)
    exits: int = 0          # ranks that said they ended normally (kvcoll's atexit)
    starts: int = 0         # ranks that said they started (kv.init)
    start_failed: str | None = None  # kv.init failed on a lost or missing peer, or Open
                                     # MPI's own start-up failed (the first such reason)
    mpi_start_crashed: bool = False  # Open MPI's own start-up failed (MPI_START_FAILED)
    stopped: int = 0        # ranks that ended because they were asked to stop (SIGUSR2)
    crashed: bool = False   # a rank crashed or called MPI_Abort
    fenced: int = 0         # ranks that exited outside the survivors' majority
    world: int | None = None   # ranks the job has now, after losses in memory (None: all)
    # {host: when (time.monotonic())} of the hosts whose ranks the survivors went on
    # without in memory: they cool down from then, and may rejoin the job after it
    lost_in_memory: dict = dataclasses.field(default_factory=dict)

    on_lost = None      # called with [(host, pid)] of the ranks survivors went on without

    def read(self, line: str) -> None:
        m = EVENT.search(line)
        if m:
            try:
                ev = json.loads(m.group(1))
            except ValueError:
                return
            self.events.append(ev)
            procs = [tuple(p) for p in ev.get("procs", []) if tuple(p) not in self.killed]
            if ev.get("event") == "lost" and ev.get("mode") == "in-memory" and procs and \
                    self.on_lost is not None:
                self.killed.update(procs)
                self.on_lost(procs)
            if ev.get("event") == "lost" and ev.get("mode") == "in-memory":
                world = ev.get("world") or []
                if len(world) == 2 and isinstance(world[1], int):
                    self.world = world[1] if self.world is None else min(self.world, world[1])
                now = time.monotonic()
                self.lost_in_memory.update((h, now) for h in ev.get("hosts", []) if h)
            if ev.get("event") in ("lost", "below_min_np", "relaunch"):
                self.lost_hosts.update(h for h in ev.get("hosts", []) if h)
                self.lost_ranks = max(self.lost_ranks, len(ev.get("ranks", [])))
            if ev.get("event") == "below_min_np":
                self.below_min = ev.get("reason") or "below --min-np"
            if ev.get("event") == "exit":
                self.exits += 1
                self.stopped += bool(ev.get("preempted"))
            if ev.get("event") == "start":
                self.starts += 1
            if ev.get("event") == "start_failed" and self.start_failed is None:
                self.start_failed = "kv.init: " + str(ev.get("error") or "failed")
            if ev.get("event") == "fenced":
                self.fenced += 1
            return
        m = RAISED.search(line)
        if m:
            self.raised.append(m.group(1).rsplit(".", 1)[-1])
            return
        if CRASHED.search(line):
            self.crashed = True
        m = MPI_START_FAILED.search(line)
        if m:
            self.mpi_start_crashed = True
        if m and self.start_failed is None:
            self.start_failed = "Open MPI's start-up failed: " + (
                "a rank crashed in MPI_Init" if "Init" in m.group(0) else
                "its PMIx server did not start")
        if not re.match(r"^\[\d+,\d+\]<", line):
            m = LOST_ON_NODE.search(line + " ")
            if m:
                self.lost_hosts.add(m.group(1) or m.group(2))
                self.lost_ranks = max(self.lost_ranks, 1)

    @property
    def lost(self) -> bool:
        return bool(self.lost_hosts or self.lost_ranks)

    @property
    def bug(self) -> str | None:
        """An ordinary error a rank raised (not a lost peer), if any."""
        return next((r for r in self.raised if r not in PEER_ERRORS), None)


def plan(o: Options, hosts: dict | None, cooling: dict, lost_local: int,
         now: float) -> tuple[dict | None, int]:
    """(the hosts to use with their slots, the number of ranks) for the next launch:
    hosts not cooling down; ranks = min(-np, --max-np, their slots). On this host alone
    (hosts None): -np (default --max-np, else --min-np) less the ranks lost so far."""
    if hosts is None:
        n = (o.np or o.max_np or o.min_np) - lost_local
        return None, n
    usable = {h: s for h, s in hosts.items() if cooling.get(h, 0) <= now}
    n = sum(usable.values())
    for cap in (o.np, o.max_np):
        if cap is not None:
            n = min(n, cap)
    return usable, n


class Grower:
    """While a launch runs: the discovery script (or hostfile) again every
    --discovery-interval seconds; when more slots are usable than the job has (hosts
    back from their cooldown, or new ones) and it has fewer than --max-np ranks, the job
    is asked to stop after its next step and save (SIGUSR2 to mpirun, which passes it
    on: what kvcollrun does for a preemption; model.fit stops every rank after the same
    step and kv.callbacks.Checkpoint saves), and kvcollrun relaunches it on the larger
    world, which restores that checkpoint resharded (the request is repeated every
    interval until the job ends). Once every rank has started. The
    job's world is the launch's less the ranks the survivors went on without in memory
    (whose hosts cool down from the loss): they rejoin here too, not only after a
    relaunch."""

    def __init__(self, o: Options, n: int, plan_now, outcome: Outcome, dog, say):
        import threading

        self.o, self.n, self.plan_now, self.outcome, self.dog = o, n, plan_now, outcome, dog
        self.say = say
        self.to = None          # (hosts, ranks) asked for
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvcollrun-grow",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(self.o.discovery_interval):
            if self.outcome.starts < self.n or self.dog.proc.poll() is not None:
                continue
            try:
                hosts, m = self.plan_now()
            except LaunchError:
                continue
            now = self.outcome.world or self.n
            if hosts is None or m <= now:
                continue
            self.to = (hosts, m)
            self.say(f"{m - now} more slot(s) usable ({_describe(hosts)}): asking the job "
                     f"to stop after its next step and save, to grow from {now} to {m} "
                     "rank(s)")
            # (again every interval until the job ends: a rank that was not in model.fit
            # yet only noted it, and fit then trained on to its end)
            while True:
                try:
                    os.kill(self.dog.proc.pid, signal.SIGUSR2)
                except ProcessLookupError:
                    return
                if self._done.wait(self.o.discovery_interval) or \
                        self.dog.proc.poll() is not None:
                    return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


class _Leaver:
    """While a launch runs: once every rank left in the job (the launch's less those the
    survivors went on without) said it ended normally, mpirun must end too; if it has
    not `kill_after` seconds later, its processes are killed and the launch counts as
    ended normally. (After a host was cut off, mpirun can wait for that host's daemon
    for ever: seen when the survivors finished before the runtime gave the daemon up.)"""

    def __init__(self, dog, outcome: Outcome, n: int, kill_after: float, say):
        import threading

        self.dog, self.outcome, self.n, self.kill_after, self.say = dog, outcome, n, \
            kill_after, say
        self.ended = False       # it killed mpirun after every rank had ended
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvcollrun-leaver",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        since = None
        while not self._done.wait(0.2):
            if self.dog.proc.poll() is not None:
                return
            o = self.outcome
            if not o.lost_in_memory or o.crashed or o.raised or \
                    o.exits < (o.world or self.n):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= self.kill_after:
                self.ended = True
                self.dog.kill_all(f"every rank left in the job ended, but mpirun did not "
                                  f"{self.kill_after:g}s later (it waits for a lost host's "
                                  "daemon)")
                return

    def stop(self) -> bool:
        """Stop watching; whether it ended mpirun after every rank had ended."""
        self._done.set()
        self._thread.join(timeout=5)
        return self.ended


def fault_flags(o: Options, mpi_opts: list) -> list:
    """ULFM's heartbeat detector and the runtime's keepalives (see the module docstring),
    each unless the command line or the environment sets it already."""
    given = {mpi_opts[i + 1] for i in range(len(mpi_opts) - 1)
             if mpi_opts[i] in ("--mca", "-mca", "--prtemca", "--gmca", "-gmca")}
    given |= {k.split("_MCA_", 1)[1] for k in os.environ
              if k.startswith(("OMPI_MCA_", "PRTE_MCA_"))}
    # (the detector's finding goes to every rank by reliable broadcast: through the
    # runtime alone, only the rank that watched a stopped or cut-off peer learnt of it,
    # and with 4 ranks the survivors' agreement then waited for the lost one)
    mca = {"mpi_ft_detector": "true", "mpi_ft_detector_thread": "true",
           "mpi_ft_detector_period": f"{o.heartbeat_period:g}",
           "mpi_ft_detector_timeout": f"{o.heartbeat_timeout:g}",
           "mpi_ft_propagator_with_rbcast": "true"}
    prte = {"oob_tcp_keepalive_time": "2", "oob_tcp_keepalive_intvl": "1",
            "oob_tcp_keepalive_probes": "5"}
    out = []
    for flag, table in (("--mca", mca), ("--prtemca", prte)):
        for k, v in table.items():
            if k not in given:
                out += [flag, k, v]
    return out


def kill_lost(procs, agent: list, say):
    """Make sure the processes the survivors went on without are gone: `kill -9 PID` on
    each one's host through `agent` (what mpirun reaches hosts with), in the background;
    a host that cannot be reached is skipped (its rank fences itself). Returns the
    thread."""
    import threading

    def run():
        for host, pid in procs:
            try:
                if _is_here(host):   # (no `kill` binary needed: a minimal system has none)
                    os.kill(int(pid), signal.SIGKILL)
                else:                # (ssh runs it in the remote shell: its builtin)
                    done = subprocess.run([*agent, host, "kill", "-9", str(int(pid))],
                                          capture_output=True, text=True,
                                          timeout=REACH_TIMEOUT, check=False)
                    if done.returncode != 0:
                        continue
                say(f"killed the lost process {pid} on {host}")
            except (OSError, subprocess.TimeoutExpired):
                pass
    t = threading.Thread(target=run, name="kvcollrun-kill-lost", daemon=True)
    t.start()
    return t


def host_flag(hosts: dict, n: int) -> list:
    """--host a:2,b:1 covering n ranks (hosts in their order, the last one partly)."""
    parts, left = [], n
    for h, s in hosts.items():
        if left <= 0:
            break
        take = min(s, left)
        parts.append(f"{h}:{take}")
        left -= take
    return ["--host", ",".join(parts)]


def run(argv: list, *, command, watchdog, say, takes_one, takes_two, kill_after: float) -> int:
    """kvcollrun --elastic: launch, relaunch on a loss, report (see the module docstring).
    command, watchdog, say: kvcollrun's mpirun command builder, its Watchdog class and
    its message printer."""
    try:
        o, mpi_opts, program = split_args(argv, takes_one, takes_two)
        hosts = discover(o)
        if hosts is not None:
            bad = unreachable(hosts, ssh_agent(mpi_opts))
            if bad:
                raise LaunchError("host(s) cannot be reached at start: " + "; ".join(
                    f"{h}: {why}" for h, why in bad.items()) + " (fix the host or leave it out)")
        _, n = plan(o, hosts, {}, 0, time.monotonic())
        if n < o.min_np:
            raise LaunchError(f"the hosts have {n} slot(s), fewer than --min-np {o.min_np}"
                              f" ({_describe(hosts)})")
    except LaunchError as exc:
        say(f"error: {exc}")
        return 2
    cooling: dict = {}
    lost_local = 0
    launches = failures = 0
    first_hosts = hosts
    while True:
        launches += 1
        flags = ["--with-ft", "ulfm", *fault_flags(o, mpi_opts)]
        if hosts is not None:
            flags += host_flag(hosts, n)
        cmd, env = command([*flags, *mpi_opts, "-np", str(n), *program], dict(os.environ),
                           os.geteuid())
        env["KVCOLL_ELASTIC_MIN_NP"] = str(o.min_np)
        env["KVCOLLRUN_LAUNCH"] = str(launches)
        cmd = _export(cmd, ["KVCOLL_ELASTIC_MIN_NP", "KVCOLLRUN_LAUNCH"])
        if os.environ.get("KVCOLLRUN_SHOW"):
            say("running " + " ".join(cmd))
        outcome = Outcome()
        agent = ssh_agent(mpi_opts)
        if not os.environ.get("KVCOLLRUN_KEEP_LOST"):   # (a test of fencing keeps them)
            outcome.on_lost = lambda procs, agent=agent, outcome=outcome: \
                outcome.kills.append(kill_lost(procs, agent, say))
        dog = watchdog(cmd, env, kill_after, on_line=outcome.read, elastic=True)
        grower = None
        if first_hosts is not None:
            grower = Grower(o, n, lambda lost_local=lost_local, outcome=outcome: plan(
                o, discover(o), _cooling(cooling, outcome, o.cooldown), lost_local,
                time.monotonic()), outcome, dog, say)
        leaver = _Leaver(dog, outcome, n, kill_after, say)
        code = dog.run()
        if leaver.stop():
            code = 0        # (every rank left in the job ended normally)
        if grower is not None:
            grower.stop()
        for t in outcome.kills:      # (the lost processes are gone before we go on)
            t.join(timeout=REACH_TIMEOUT)
        cooling.update(_cooling(cooling, outcome, o.cooldown))
        if grower is not None and grower.to is not None and code == 0 and outcome.stopped \
                and not dog.signals:
            hosts, n = grower.to
            say(f"the job stopped and saved: relaunching on {n} rank(s) ({_describe(hosts)}) "
                "from that checkpoint")
            continue
        # (Open MPI's runtime ends every rank when it loses a daemon, and mpirun may exit 0
        # then, or after ranks aborted: a kvcoll job finished only if some rank said it
        # ended normally, and none crashed or aborted)
        # (a rank fenced off exits non-zero while the others may finish)
        failed = outcome.crashed or outcome.raised
        if (code == 0 or (outcome.fenced and outcome.exits)) and not failed and \
                (outcome.exits or not (outcome.lost or outcome.starts)):
            if launches > 1 or outcome.lost:
                say(f"the job recovered and finished ({launches} launch(es))")
            return 0
        if dog.signals:
            return code
        if outcome.below_min:
            say(f"the job stopped below --min-np {o.min_np}: {outcome.below_min}")
            return code or 1
        if outcome.mpi_start_crashed and not outcome.starts:
            # Open MPI's own start-up crashed before any rank began (ULFM's defect, 1-4%
            # of elastic launches): no host or rank is to blame, though mpirun reports
            # the crashed ranks' hosts; the relaunch has them all
            outcome.lost_hosts.clear()
            outcome.lost_ranks = 0
        # a relaunch that did not come up; or any launch whose kv.init failed on a peer
        # lost or missing before anything began (never an error of the program's own)
        retry = outcome.starts < n and (launches > 1 or outcome.start_failed is not None)
        if not outcome.lost and not retry:
            say("the job failed without losing a rank or host"
                + (f" (a rank raised {outcome.bug})" if outcome.bug else "")
                + ": not relaunching (a relaunch would fail the same way)")
            return code or 1
        failures += 1
        if failures > o.max_relaunches:
            say(f"lost {_describe_lost(outcome)} again, after {o.max_relaunches} relaunch(es) "
                "(--max-relaunches): giving up")
            return code or 1
        now = time.monotonic()
        for h in outcome.lost_hosts - outcome.lost_in_memory.keys():  # (those: from the loss)
            cooling[h] = now + o.cooldown
        if first_hosts is None and outcome.lost:   # (a start that failed lost no slot)
            lost_local += max(1, outcome.lost_ranks)
        deadline = now + o.elastic_timeout
        while True:
            try:
                found = discover(o)
            except LaunchError as exc:
                say(f"error: {exc}")
                return code or 1
            hosts, n = plan(o, found, cooling, lost_local, time.monotonic())
            if n >= o.min_np or time.monotonic() >= deadline:
                break
            time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
        if n < o.min_np:
            say(f"lost {_describe_lost(outcome)}: {n} slot(s) left "
                f"({_describe(hosts)}), fewer than --min-np {o.min_np}, for "
                f"{o.elastic_timeout:g}s (--elastic-timeout): giving up")
            return code or 1
        why = f"lost {_describe_lost(outcome)}" if outcome.lost else \
            f"the {'relaunch' if launches > 1 else 'job'} did not come up ({outcome.starts} " \
            f"of {n} rank(s) started" + (f"; {outcome.start_failed}"
                                         if outcome.start_failed else "") + ")"
        say(f"{why}: relaunching on {n} rank(s) ({_describe(hosts)}) from the latest "
            f"checkpoint (relaunch {failures} of at most {o.max_relaunches})")
        time.sleep(RELAUNCH_PAUSE)


def _cooling(cooling: dict, outcome: Outcome, cooldown: float) -> dict:
    """{host: until when it cools down}: `cooling` and the hosts the survivors of
    `outcome` went on without in memory (from the moment of that loss)."""
    out = dict(cooling)
    for h, t in outcome.lost_in_memory.items():
        out[h] = max(out.get(h, 0.0), t + cooldown)
    return out


def _export(cmd: list, names: list) -> list:
    """cmd with `-x NAME` for each name not already exported (right after mpirun)."""
    have = {cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i] == "-x"}
    extra = [a for n in names if n not in have for a in ("-x", n)]
    return [cmd[0], *extra, *cmd[1:]]


def _describe(hosts: dict | None) -> str:
    if hosts is None:
        return "this host"
    return ", ".join(f"{h}:{s}" for h, s in hosts.items()) or "no host"


def _describe_lost(o: Outcome) -> str:
    if o.lost_hosts:
        return "host(s) " + ", ".join(sorted(o.lost_hosts))
    return f"{max(1, o.lost_ranks)} rank(s)"


if __name__ == "__main__":  # pragma: no cover - kvcollrun is the entry point
    sys.exit("run launch/kvcollrun --elastic ...")
