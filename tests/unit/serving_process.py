"""`kvcoll serve` in a child process for tests: started on ports it picks itself (port
0; the ports it bound are read from its ready line), and always stopped: SIGTERM, then
SIGKILL after a few seconds, pass or fail."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

READY = re.compile(r"ready model=(\S+) version=(\d+) grpc=(\S+) rest=(\S+)")


class Served:
    def __init__(self, proc, m, log):
        self.proc, self.log = proc, log
        self.name, self.version = m.group(1), int(m.group(2))
        self.grpc, self.rest = m.group(3), "http://" + m.group(4)


@contextlib.contextmanager
def serving(directory, *args, timeout: float = 180.0):
    cmd = [sys.executable, "-m", "kvcoll.serve", str(directory), "--grpc-port", "0",
           "--rest-port", "0", *map(str, args)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    log = []
    errs = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    errs.start()
    try:
        found, deadline = None, time.monotonic() + timeout
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        while found is None and time.monotonic() < deadline and proc.poll() is None:
            for line in list(lines):
                found = found or READY.search(line)
            time.sleep(0.1)
        for line in list(lines):
            found = found or READY.search(line)
        if found is None:
            raise AssertionError(f"kvcoll serve did not become ready (exit {proc.poll()}):\n"
                                 + "".join(log[-30:]))
        yield Served(proc, found, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
