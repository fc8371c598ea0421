"""How a kvcoll job starts and ends on one host, under mpirun with a timeout: an error in
any thread of any rank ends the whole job; a job that leaves SSP service threads running
exits cleanly; a communicator some rank never creates ends with a deadline error."""

import time

from mpirun import run

THREAD_RAISES = """
import threading, time, numpy as np, kvcoll as kv
kv.init(argv=[])
if kv.rank() == 1:
    def boom():
        raise RuntimeError("a helper thread of rank 1 broke")
    threading.Thread(target=boom, name="helper").start()
kv.allreduce(np.ones(1))           # rank 0 waits here for rank 1 ...
time.sleep(60)                     # ... and nobody reaches the end
print("should not get here", flush=True)
"""


def test_an_exception_in_any_thread_ends_the_job():
    t0 = time.monotonic()
    code, out = run(2, ["-c", THREAD_RAISES], 120, "a rank's thread raising")
    assert code != 0, out[-3000:]
    assert "raised RuntimeError in thread 'helper'; aborting the job" in out, out[-3000:]
    assert "should not get here" not in out
    assert time.monotonic() - t0 < 60


SSP_LEFT_RUNNING = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, kvcoll as kv
kv.init(argv=[], step_mode="ssp", staleness=1)
u = keras.Input(shape=(), dtype="int64", name="u")
m = kv.Model(u, keras.layers.Dense(1)(kv.Embedding("u", 2)(u)))
m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
m.fit(np.arange(8) + 8 * kv.rank(), np.zeros(8), batch_size=4, verbose=0)
print("rank", kv.rank(), "done", flush=True)
# no close(), no shutdown(): the service thread is still up when Python exits
"""


def test_a_job_that_leaves_its_service_threads_running_exits_cleanly():
    code, out = run(2, ["-c", SSP_LEFT_RUNNING], 180, "an SSP job exiting")
    assert code == 0, out[-3000:]
    assert "rank 0 done" in out and "rank 1 done" in out


DUP_SKIPPED = """
import time, numpy as np, kvcoll as kv
from kvcoll.comm import Comm
kv.init(argv=[], startup_timeout=3.0)
c = kv.runtime.comm()
if kv.rank() == 0:
    Comm(c._comm, c.timeouts["step"], c.timeouts)          # rank 1 does not take part
time.sleep(60)
print("should not get here", flush=True)
"""


def test_a_communicator_one_rank_never_creates_ends_with_a_deadline():
    """Rank 0 waits for a new communicator rank 1 never creates: after the startup
    deadline it raises naming the operation and the setting, and the job ends."""
    t0 = time.monotonic()
    code, out = run(2, ["-c", DUP_SKIPPED], 120, "a dup one rank skips")
    assert code != 0, out[-3000:]
    assert "rank 0/2: dup (a new communicator: every rank must create it) did not " \
        "complete within 3s" in out, out[-3000:]
    assert "KVCOLL_STARTUP_TIMEOUT" in out and "should not get here" not in out
    assert time.monotonic() - t0 < 45


PREEMPTED = """
import os, signal, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, kvcoll as kv
kv.init(argv=[])
ck_dir = sys.argv[1]
keras.utils.set_random_seed(0)
u = keras.Input(shape=(), dtype="int64", name="u")
m = kv.Model(u, keras.layers.Dense(1)(kv.Embedding("u", 2)(u)))
m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
ck = kv.callbacks.Checkpoint(ck_dir, every_n_steps=100, restore=True)

class Sigterm(keras.callbacks.Callback):   # the last rank alone is told to stop
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4 and kv.rank() == kv.size() - 1 and not ck.restored:
            os.kill(os.getpid(), signal.SIGTERM)

x = np.arange(400) + 400 * kv.rank()
h = m.fit(x, np.zeros(400), batch_size=8, verbose=0, callbacks=[ck, Sigterm()])
if h.preempted:        # fit returned: the script decides what a preempted job does
    print("rank", kv.rank(), "preempted at step", kv.keras.engine_of(m).step, flush=True)
    sys.exit(0)
print("rank", kv.rank(), "ran to the end from step", ck.restored.step if ck.restored else 0,
      "to", kv.keras.engine_of(m).step, flush=True)
"""


def test_sigterm_stops_every_rank_after_the_same_step_saves_and_exits_0(tmp_path):
    ck = tmp_path / "ck"
    code, out = run(2, ["-c", PREEMPTED, ck], 180, "a preempted fit")
    assert code == 0, out[-3000:]
    assert "kvcoll: preempted (SIGTERM): every rank stopped after step 5" in out, out[-3000:]
    assert "rank 0 preempted at step 5" in out and "rank 1 preempted at step 5" in out
    assert "ran to the end" not in out
    assert (ck / "latest").read_text() == "ckpt-0000000005\n"
    code, out = run(2, ["-c", PREEMPTED, ck], 180, "the restart")
    assert code == 0, out[-3000:]
    # the restart continues the preempted epoch (step 5 of 50), it does not begin a new one
    assert "kvcoll: the next fit continues at epoch 1, step 5" in out, out[-3000:]
    assert "resumed in epoch 1 after step 5 of 50: 45 left" in out, out[-3000:]
    assert "rank 0 ran to the end from step 5 to 50" in out, out[-3000:]


LONG_FIT = """
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, kvcoll as kv
kv.init(argv=[])
keras.utils.set_random_seed(0)
u = keras.Input(shape=(), dtype="int64", name="u")
m = kv.Model(u, keras.layers.Dense(1)(kv.Embedding("u", 2)(u)))
m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")

class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and kv.rank() == 0:
            print("training", flush=True)
        time.sleep(0.05)

x = np.arange(4000) + 4000 * kv.rank()
h = m.fit(x, np.zeros(4000), batch_size=8, verbose=0,
          callbacks=[kv.callbacks.Checkpoint(sys.argv[1], every_n_steps=10000), Slow()])
print("preempted" if h.preempted else "ran to the end", flush=True)
"""


def test_sigterm_to_kvcollrun_preempts_the_job_which_saves_and_exits_0(tmp_path):
    """What Kubernetes or SLURM do to the launcher: kvcollrun relays SIGTERM as SIGUSR2,
    which mpirun passes on without killing the ranks; fit stops them after one step,
    saves and exits 0."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    ck = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=str(root), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([str(root / "launch" / "kvcollrun"), "-np", "2", sys.executable,
                             "-c", LONG_FIT, str(ck)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "training" in line:
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "kvcoll: preempted (SIGTERM): every rank stopped after step" in out, out[-3000:]
    assert "ran to the end" not in out and time.monotonic() - t0 < 60
    saved = (ck / "latest").read_text().strip()
    assert saved.startswith("ckpt-") and int(saved[5:]) >= 4
