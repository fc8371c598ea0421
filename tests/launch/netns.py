"""Several "hosts" on this machine for multi-host tests: network namespaces joined by
veth links to a bridge in the root namespace, each with a host name of its own (a UTS
namespace), and Open MPI launching ranks into them over TCP alone.

    hosts = Hosts.create(3)              # pytest.skip()s when the machine cannot
    code, out = hosts.run(["-np", "3", sys.executable, "job.py"], timeout=120)
    hosts.link_down(2)                   # cut host 2 off (its end of the link)
    hosts.close()                        # every process in them killed, links and
                                         # namespaces removed
    job = Job([KVCOLLRUN, ...], hosts.env())   # a job whose output lines keep their
    job.wait_line(r"step 10"); job.end(60)     # arrival times

mpirun (through launch/kvcollrun) runs in the root namespace, as on a login node, and
starts one PRRTE daemon per host through its remote-launch agent setting
(`--prtemca plm_ssh_agent AGENT`): the agent is a small script that runs the daemon's
command inside the host's namespace with the host's name (`ip netns exec NS unshare
--uts sh -c "hostname H; COMMAND"`), where ssh would run it on a real host. The MPI
traffic and PRRTE's own go over TCP on the test subnet only (`--mca btl tcp,self`, no
shared memory; `btl_tcp_if_include` and `oob_tcp_if_include` on the subnet).

Names carry the test process's pid (kvt<pid>...), so runs never collide, and a run that
was killed before it could clean up is cleaned up by the next one.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mpirun import LAUNCH_FAILED, pid_alive

ROOT = Path(__file__).resolve().parent.parent.parent
KVCOLLRUN = ROOT / "launch" / "kvcollrun"
PYTHON = sys.executable


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def cleanup_stale() -> None:
    """Remove the namespaces and bridges of earlier runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(r"(kvt(\d+)h\d+)\b", line)
        if m and not pid_alive(int(m.group(2))):
            _kill_in(m.group(1))
            _ip("netns", "del", m.group(1), check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.search(r"^\d+: (kvt(\d+)b)[:@]", line)
        if m and not pid_alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _kill_in(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in namespace ns until none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _ns_pids(ns)
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no interface of this machine is on."""
    used = [ipaddress.ip_interface(a).network for a in
            re.findall(r"inet (\S+)", _ip("-o", "-4", "addr", "show", check=False).stdout)]
    start = os.getpid() % 200
    for k in range(256):
        net = ipaddress.ip_network(f"10.213.{(start + k) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    pytest.skip("no free /24 in 10.213.0.0/16 for the test hosts")


class Hosts:
    """n hosts (network namespaces) on one bridge; see the module docstring."""

    def __init__(self, n: int, workdir: Path, slots: list[int] | None = None):
        self.n = n
        self.tag = f"kvt{os.getpid()}"
        self.bridge = f"{self.tag}b"
        self.names = [f"kvhost{i + 1}" for i in range(n)]
        self.namespaces = [f"{self.tag}h{i + 1}" for i in range(n)]
        self.links = [f"{self.tag}v{i + 1}" for i in range(n)]   # the bridge's ends
        self.workdir = Path(workdir)
        self.slots = slots or [1] * n
        self.created: list[tuple[str, str]] = []   # (kind, name), to undo in reverse
        self.net = None
        self.addresses: list[str] = []

    # -- making and unmaking ---------------------------------------------------------

    @classmethod
    def create(cls, n: int, workdir, slots: list[int] | None = None) -> Hosts:
        """n hosts, or pytest.skip() with the reason when this machine cannot make them
        (not root, no `ip`/`unshare`, no CAP_NET_ADMIN, no UTS namespaces)."""
        reason = cls.unavailable()
        if reason:
            pytest.skip(reason)
        cleanup_stale()
        hosts = cls(n, workdir, slots)
        try:
            hosts._make()
        except BaseException:
            hosts.close()
            raise
        return hosts

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot make test hosts, or None."""
        if not sys.platform.startswith("linux"):
            return "test hosts are Linux network namespaces"
        if os.geteuid() != 0:
            return "test hosts need root (network and UTS namespaces, veth links)"
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                return f"test hosts need the `{tool}` command (iproute2, util-linux)"
        probe = f"kvt{os.getpid()}probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace (needs CAP_NET_ADMIN and CAP_SYS_ADMIN): " \
                   f"{made.stderr.strip()}"
        try:
            uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "sh",
                                  "-c", "hostname kvprobe && hostname"], capture_output=True,
                                 text=True, timeout=30)
            if uts.returncode != 0 or uts.stdout.strip() != "kvprobe":
                return f"cannot give a namespace a host name of its own (unshare --uts): " \
                       f"{uts.stderr.strip()}"
        finally:
            _ip("netns", "del", probe, check=False)
        return None

    def _make(self) -> None:
        # what an earlier Hosts of this process left (a namespace is destroyed by the
        # kernel some time after its deletion, and its veth with it): names are per pid
        for name in (self.bridge, *self.links):
            _ip("link", "del", name, check=False)
        for ns in self.namespaces:
            _kill_in(ns)
            _ip("netns", "del", ns, check=False)
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        gateway = hosts[0]
        self.addresses = [str(hosts[10 + i]) for i in range(self.n)]
        _ip("link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        _ip("addr", "add", f"{gateway}/{self.net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, link, addr in zip(self.namespaces, self.links, self.addresses):
            _ip("netns", "add", ns)
            self.created.append(("netns", ns))
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.created.append(("link", link))    # deleted before its namespace, at once
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.agent = self.workdir / "agent"
        cases = "\n".join(f"  {h}) ns={ns} ;;" for h, ns in zip(self.names, self.namespaces))
        self.agent.write_text(
            "#!/bin/sh\n"
            "# Open MPI's remote-launch agent for the test hosts: `agent HOST COMMAND...`\n"
            "# runs COMMAND in HOST's network namespace with HOST's name, as ssh would.\n"
            'host=$1; shift\ncase "$host" in\n'
            f"{cases}\n"
            '  *) echo "agent: no test host named $host" >&2; exit 255 ;;\nesac\n'
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $host; $*"\n')
        self.agent.chmod(0o755)
        self.hostfile = self.hostfile_for(range(self.n))

    def hostfile_for(self, which, slots: list[int] | None = None) -> Path:
        """A hostfile of some of the hosts (indices), with their slots."""
        which = list(which)
        slots = slots or [self.slots[i] for i in which]
        path = self.workdir / ("hosts-" + "-".join(str(i + 1) for i in which))
        path.write_text("".join(f"{self.names[i]} slots={s}\n" for i, s in zip(which, slots)))
        return path

    def close(self) -> None:
        """Kill every process in the hosts, then remove them and their links (also
        after a failure; safe to call twice)."""
        for kind, name in reversed(self.created):
            if kind == "netns":
                _kill_in(name)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self.created.clear()

    # -- using them ------------------------------------------------------------------

    def mpi_args(self, hostfile: Path | None = None) -> list[str]:
        """mpirun options: the hosts, the agent, TCP on the test subnet only."""
        subnet = str(self.net)
        return ["--hostfile", str(hostfile or self.hostfile),
                "--prtemca", "plm_ssh_agent", str(self.agent),
                "--prtemca", "plm_ssh_no_tree_spawn", "1",
                "--prtemca", "oob_tcp_if_include", subnet,
                "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", subnet]

    def env(self, extra: dict | None = None) -> dict:
        env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
                   PATH=f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}")
        env.pop("KVCOLL_STEP_MODE", None)
        env.update(extra or {})
        return env

    def start(self, argv: list, env_extra: dict | None = None,
              hostfile: Path | None = None) -> subprocess.Popen:
        """Start `kvcollrun <hosts> argv...` (output merged, a new session)."""
        cmd = [str(KVCOLLRUN), *self.mpi_args(hostfile), *map(str, argv)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=self.env(env_extra), cwd=ROOT,
                                start_new_session=True)

    def run(self, argv: list, timeout: float, what: str, env_extra: dict | None = None,
            hostfile: Path | None = None) -> tuple[int, str]:
        """Run a job to its end; (exit code, output). Past `timeout` the test fails and
        every process of the job is killed. A launch that failed before any rank started
        (mpirun.LAUNCH_FAILED: Open MPI's own start-up) is tried once more."""
        code, out = self._run(argv, timeout, what, env_extra, hostfile)
        if code != 0 and any(m in out for m in LAUNCH_FAILED):
            print(f"{what}: mpirun could not start ({out.strip()[:200]!r}); trying again")
            code, out = self._run(argv, timeout, what, env_extra, hostfile)
        return code, out

    def _run(self, argv, timeout, what, env_extra, hostfile) -> tuple[int, str]:
        proc = self.start(argv, env_extra, hostfile)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            for ns in self.namespaces:
                _kill_in(ns)
            out, _ = proc.communicate()
            pytest.fail(f"{what} on the test hosts did not finish in {timeout:.0f}s "
                        f"(deadlock?)\n{out[-6000:]}")
        return proc.returncode, out

    def pids(self, i: int) -> list[int]:
        """The processes running in host i."""
        return _ns_pids(self.namespaces[i])

    def ranks(self, i: int, marker: str) -> list[int]:
        """The processes in host i whose command line contains `marker`."""
        out = []
        for p in self.pids(i):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd:
                out.append(p)
        return out

    def link_down(self, i: int) -> None:
        """Cut host i off: its end of the link goes down (inside its namespace)."""
        _ip("-n", self.namespaces[i], "link", "set", "eth0", "down")

    def link_up(self, i: int) -> None:
        _ip("-n", self.namespaces[i], "link", "set", "eth0", "up")

    def kill_all(self, i: int) -> None:
        """SIGKILL every process in host i."""
        _kill_in(self.namespaces[i])


class Job:
    """A command (kvcollrun on the hosts, say) started in a session of its own, its
    output merged; every line kept with its arrival time on `clock` (on_line() sees it
    as it comes), so that a test or a benchmark can tell when something happened."""

    def __init__(self, cmd: list, env: dict, clock=time.monotonic):
        self.clock = clock
        self.t0 = clock()
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=env, start_new_session=True)
        self.lines: list = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t, line = self.clock(), line.rstrip("\n")
            self.lines.append((t, line))
            self.on_line(t, line)

    def on_line(self, t: float, line: str) -> None:
        """Called for each output line as it arrives (on the reader thread)."""

    def wait_line(self, pattern: str, after: float = float("-inf"),
                  timeout: float = 120) -> float | None:
        """When the first line matching `pattern` arrived after `after`; None if none did
        within `timeout` seconds (or before the job ended)."""
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if t > after and rx.search(line):
                    return t
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                hit = [t for t, line in list(self.lines) if t > after and rx.search(line)]
                return hit[0] if hit else None
            time.sleep(0.02)
        return None

    def since(self, after: float, pattern: str) -> list:
        """(time, line) of every line matching `pattern` that arrived after `after`."""
        rx = re.compile(pattern)
        return [(t, line) for t, line in list(self.lines) if t > after and rx.search(line)]

    def end(self, timeout: float) -> int | None:
        """The exit code; None when the job did not end within `timeout` seconds (it is
        killed then)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """SIGKILL the job's whole session."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self, last: int | None = None) -> str:
        """The output so far (its `last` lines)."""
        lines = self.lines if last is None else self.lines[-last:]
        return "\n".join(line for _, line in lines)
