"""A collective that times out names the rank it lost, the operation and the step (the
liveness check of kvcoll/comm.py), on one host under mpirun; and a rank whose MPI_Abort
cannot end it exits by itself.

- rank 2 stops taking part (it sleeps outside kvcoll): ranks 0 and 1 time out in the
  step's collective and both say "lost rank(s) [2]", its pid and host, that its process
  runs outside kvcoll, what the other survivor waits in, and the step (a stopped rank:
  tests/launch/test_frozen_rank.py);
- every rank is alive but rank 1 waits for something else: the error says so (no rank
  is lost; the calls differ);
- MPI_Abort that never returns (as when the launcher is out of reach): the rank exits
  ABORT_EXIT_AFTER seconds later all the same.
"""

import re
import time

from mpirun import run

LOST = """
import os, socket, time, numpy as np, kvcoll as kv
kv.init(argv=[], comm_timeout=2.0)
print(f"rank {kv.rank()} pid {os.getpid()} host {socket.gethostname()}", flush=True)
c = kv.runtime.comm()
c.step = 41                                   # as the exchange sets it
kv.allreduce(np.ones(1))
if kv.rank() == 2:
    time.sleep(30)                            # alive, but gone from kvcoll's calls
kv.allreduce(np.ones(1))
"""


def test_a_timed_out_collective_names_the_lost_rank_and_the_step():
    t0 = time.monotonic()
    code, out = run(3, ["-c", LOST], 120, "a rank that stops taking part")
    assert code != 0, out[-3000:]
    pid, host = re.search(r"rank 2 pid (\d+) host (\S+)", out).groups()
    for r, other in ((0, 1), (1, 0)):
        assert (f"rank {r}/3: kv.allreduce at step 41 did not complete within 2s: lost "
                f"rank(s) [2], no progress and no sign of life within 2s: rank 2 (pid {pid} "
                f"on host {host}) is running but not waiting in kvcoll: busy in other code "
                "or stuck (a deadlock, a long computation, a blocking call); alive: rank "
                f"{other} waits in kv.allreduce at step 41 (raise the limit with "
                "KVCOLL_COMM_TIMEOUT)") in out, out[-3000:]
    assert time.monotonic() - t0 < 25


MISMATCH = """
import numpy as np, kvcoll as kv
kv.init(argv=[], comm_timeout=2.0)
c = kv.runtime.comm()
if kv.rank() == 1:
    c.recv(0, 9, op="a message nobody sends", timeout=20.0)
else:
    kv.allreduce(np.ones(1))
"""


def test_different_collectives_are_told_apart_from_a_lost_rank():
    code, out = run(2, ["-c", MISMATCH], 120, "ranks in different collectives")
    assert code != 0, out[-3000:]
    assert ("rank 0/2: kv.allreduce did not complete within 2s, yet every rank is alive "
            "(rank 1 waits in a message nobody sends): the ranks issued different "
            "calls") in out, out[-3000:]


ABORT_HANGS = """
import time, kvcoll as kv
from kvcoll import comm as kvcomm
kv.init(argv=[])
kvcomm.Comm.abort = lambda self, code=1: time.sleep(60)   # MPI_Abort never returns
if kv.rank() == 1:
    raise RuntimeError("rank 1 fails")
time.sleep(60)
"""


def test_a_rank_whose_abort_hangs_exits_by_itself():
    t0 = time.monotonic()
    code, out = run(2, ["-c", ABORT_HANGS], 120, "an abort that hangs")
    elapsed = time.monotonic() - t0
    assert code != 0, out[-3000:]
    assert "kvcoll: rank 1 raised RuntimeError; aborting the job" in out, out[-3000:]
    assert "Timeout (0:00:05)!" in out, out[-3000:]     # faulthandler's exit, after 5 s
    assert elapsed < 40, (elapsed, out[-3000:])
