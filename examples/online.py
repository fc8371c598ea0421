"""Online learning end to end: train on a stream of files while `kvcoll serve` serves
the freshest rows, and see what freshness buys.

    python examples/online.py                      # or: ./dev demo --online
    python examples/online.py --hours 8 --hour-seconds 20 --plot online.png

What runs (every process is started here and stopped here, pass or fail):

- a data pipeline (a thread of this process) lands Parquet files into
  `landing/hour=HHH/`, each written under a temporary name and renamed into place, from
  a synthetic click log whose planted model drifts: new items appear every hour and
  take the top of the popularity ranking while the old ones fade, and the click rate
  of each item category swings with the hour of the day;
- 2 training ranks (mpirun) read the directory with `kv.data.stream(...)` and train
  with `model.fit(stream.dataset(), steps_per_epoch=...)`, publishing a version every
  5 s with `kv.callbacks.Publish` and checkpointing with `kv.callbacks.Checkpoint`
  (a training job started again resumes from its checkpoint, at the stream position
  it recorded);
- one `kvcoll serve` follows the publish directory and applies each version live;
- a client (this process) scores the newest data as it lands: the held-out samples of
  each new file, through the server's gRPC API (TensorFlow Serving's
  PredictionService), and through a model frozen at the end of the first hour (the
  same serving code, in this process, never updated).

It prints, for every hour, the served model's AUC next to the frozen model's (from the
second hour on) and the best any model can reach (the planted model's), and the
server's freshness lag (now minus the wall time of the training step it serves); it
plots both into a PNG. Lines tagged `# kvcoll:` are what a training script adds to run on kvcoll.

Roles: the same file is the training job (`--role train`, started by the driver under
mpirun). `DriftingClicks`, `land`, `Cluster` and `Client` are reused by
bench/online_bench.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ---- the drifting click log ---------------------------------------------------------------

_M64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
PROBE_BASE = 1 << 50          # item ids of freshness probes (bench/online_bench.py)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _hash(key: int, ids) -> np.ndarray:
    """A pseudo-random uint64 per id, a pure function of (key, id)."""
    x = np.asarray(ids).astype(np.uint64)
    return _mix(x * _GAMMA + np.uint64(key & _M64))


def _unit(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _gauss(key: int, ids) -> np.ndarray:
    """A standard normal per id (Box-Muller on two hashes), a pure function of it."""
    u1 = _unit(_hash(key, ids))
    u2 = _unit(_hash(key ^ 0x5DEECE66D, ids))
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def _zipf(u: np.ndarray, n: int, a: float) -> np.ndarray:
    """Ranks in [0, n) with P(r) about proportional to (r + 1.5)^-a (inverse CDF of a
    power law on [1, n + 1))."""
    c = (n + 1.0) ** (1.0 - a) - 1.0
    r = np.floor((1.0 + u * c) ** (1.0 / (1.0 - a))) - 1.0
    return np.clip(r, 0, n - 1).astype(np.int64)


class DriftingClicks:
    """A click log whose planted model drifts with time t (in hours).

    Each sample is (user, item, cat, click). Users: `users` of them, Zipf-popular,
    each with a fixed effect. Items: item j is born at hour (j - live_items) /
    new_items_per_hour, and a sample's item is the one of popularity rank r (Zipf over
    the `live_items` youngest) among those born by its time: every hour brings
    `new_items_per_hour` new items at the top while the older ones fade down the
    ranking and out. Each item has a fixed effect and a category (`categories` of
    them) whose effect swings with the hour, each category in its own phase, over
    `period_hours`; the mean click rate swings too. The label is Bernoulli(sigmoid(
    bias(t) + user + item + category(t))): `logit` is what it was drawn from, so its AUC
    is the best any model can reach.

    Everything is a function of (seed, stream, t0): stream 0 is what lands for
    training, stream 1 the held-out samples the client scores, never trained on.
    """

    def __init__(self, seed: int = 0, users: int = 2_000, live_items: int = 3_000,
                 new_items_per_hour: int = 600, categories: int = 24, zipf_a: float = 1.1,
                 period_hours: float = 6.0, user_scale: float = 0.6, item_scale: float = 1.2,
                 category_scale: float = 1.0):
        self.seed, self.users, self.live = int(seed), int(users), int(live_items)
        self.new_per_hour, self.categories = int(new_items_per_hour), int(categories)
        self.zipf_a, self.period = float(zipf_a), float(period_hours)
        self.scales = (float(user_scale), float(item_scale), float(category_scale))
        self._perm = np.random.default_rng([self.seed, 7]).permutation(self.users)

    def newest(self, t: float) -> int:
        """The item ids born by hour t are [0, newest(t))."""
        return self.live + math.floor(t * self.new_per_hour)

    def item_category(self, items: np.ndarray) -> np.ndarray:
        return (_hash(self.seed * 31 + 3, items) % np.uint64(self.categories)).astype(np.int64)

    def logit(self, t, user, item, cat) -> np.ndarray:
        """The planted logit of samples at hours t."""
        su, si, sc = self.scales
        phase = 2 * np.pi * _unit(_hash(self.seed * 31 + 4, cat))
        angle = 2 * np.pi * np.asarray(t) / self.period
        bias = -1.4 + 0.3 * np.sin(angle)
        return (bias + su * _gauss(self.seed * 31 + 1, user)
                + si * _gauss(self.seed * 31 + 2, item)
                + sc * np.sin(angle + phase))

    def samples(self, t0: float, t1: float, n: int, stream: int = 0) -> dict:
        """n samples at hours uniform in [t0, t1): {"user", "item", "cat" (int64),
        "click" (int8), "logit" (float64), "t" (float64)}."""
        rng = np.random.default_rng([self.seed, stream, round(t0 * 1e6)])
        t = np.sort(t0 + (t1 - t0) * rng.random(n))
        user = self._perm[_zipf(rng.random(n), self.users, 1.05)].astype(np.int64)
        rank = _zipf(rng.random(n), self.live, self.zipf_a)
        newest = self.live + np.floor(t * self.new_per_hour).astype(np.int64)
        item = newest - 1 - rank
        cat = self.item_category(item)
        logit = self.logit(t, user, item, cat)
        click = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
        return {"user": user, "item": item, "cat": cat, "click": click, "logit": logit, "t": t}


def land(directory: str, name: str, columns: dict, row_groups: int = 2) -> str:
    """Write a Parquet file as a data pipeline does: under a temporary name (which
    kv.data.stream ignores), then renamed into place. Returns the final path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    table = pa.table({"user": pa.array(columns["user"], pa.int64()),
                      "item": pa.array(columns["item"], pa.int64()),
                      "cat": pa.array(columns["cat"], pa.int64()),
                      "click": pa.array(columns["click"], pa.int8())})
    final = os.path.join(directory, name)
    tmp = final + ".tmp"
    rows = len(columns["click"])
    pq.write_table(table, tmp, row_group_size=max(1, -(-rows // row_groups)))
    os.rename(tmp, final)
    return final


# ---- the training job (--role train, one process per rank under mpirun) -------------------

def build_model(dim: int, hidden: int, evict_after_steps: int | None = None):
    """user, item and cat ids -> the click logit: three kvcoll tables and a small MLP.
    evict_after_steps: item rows not trained for that many steps are evicted (faded
    items leave the table, and the next published version removes them)."""
    import keras

    import kvcoll as kv

    inputs = {c: keras.Input(shape=(), dtype="int64", name=c) for c in ("user", "item", "cat")}
    vecs = [kv.Embedding(c, dim, initializer=("normal", 0.0, 0.01),  # kvcoll: tables
                         evict_after_steps=evict_after_steps if c == "item" else None)(x)
            for c, x in inputs.items()]
    h = keras.layers.Concatenate()(vecs)
    h = keras.layers.Dense(hidden, activation="relu")(h)
    return kv.Model(inputs, keras.layers.Dense(1, name="logit")(h))  # kvcoll: fit runs kvcoll


def train(args) -> int:
    import kvcoll as kv

    kv.init(argv=[])  # kvcoll: MPI up; TensorFlow gets this rank's share of the cores
    import keras

    keras.utils.set_random_seed(args.seed)
    model = build_model(args.dim, args.hidden, args.evict_after_steps or None)
    model.compile(optimizer=kv.DistributedOptimizer(  # kvcoll: rows: Adagrad in C
        keras.optimizers.Adam(args.lr), sparse=kv.optimizers.Adagrad(args.sparse_lr)),
        loss=keras.losses.BinaryCrossentropy(from_logits=True))
    work = args.workdir
    # kvcoll: the files landing under landing/, each rank its share of each, in arrival
    # order; idle_timeout=None waits for files for ever (the driver stops the job)
    stream = kv.data.stream(os.path.join(work, "landing", "hour=*", "*.parquet"),
                            args.batch_size, label="click", categorical=["user", "item", "cat"],
                            idle_timeout=None, idle_poll=0.25, settle=args.settle)
    callbacks = [
        # kvcoll: checkpoints hold the stream's position: a restarted job resumes there
        kv.callbacks.Checkpoint(os.path.join(work, "checkpoints"),
                                every_n_steps=args.checkpoint_every, max_to_keep=2,
                                restore=True),
        # kvcoll: a version for kvcoll serve every few seconds (rows changed since the last)
        _LoggedPublish(os.path.join(work, "publish"), every_seconds=args.publish_every,
                       base_every=args.base_every),
        _Progress(work),
    ]
    if args.evict_after_steps:
        callbacks.append(kv.callbacks.Evict(every_n_steps=50))  # kvcoll: faded items go
    # An "epoch" of an unbounded stream is steps_per_epoch steps; the job runs until it
    # is told to stop (SIGTERM, or SIGUSR2 as mpirun relays it): every rank then stops
    # after the same step, and the callbacks publish and checkpoint once more.
    model.fit(stream.dataset(), steps_per_epoch=args.steps_per_epoch, epochs=10**9,
              verbose=0, callbacks=callbacks)
    eng = kv.keras.engine_of(model)
    if kv.rank() == 0:
        print(f"training stopped at step {eng.step}", flush=True)
    kv.shutdown()
    return 0


def _LoggedPublish(*args, **kwargs):
    """kv.callbacks.Publish that logs each version on rank 0 (made lazily: no Keras at
    import)."""
    import kvcoll as kv

    class LoggedPublish(kv.callbacks.Publish):
        def on_publish(self, info):
            if kv.rank() == 0:
                print(f"published version {info.version} ({'+'.join(info.kinds)}) at step "
                      f"{info.step}: {info.rows:,} rows, {info.removed:,} removed, "
                      f"{info.bytes / 2**20:.2f} MiB, dense {'yes' if info.dense else 'no'}, "
                      f"{1000 * info.seconds:.0f} ms [wall {time.time():.3f}]", flush=True)

    return LoggedPublish(*args, **kwargs)


class _Progress:
    """Each rank appends "step samples time" (its samples so far) after every step to
    workdir/progress.r<rank>.log (flushed at once): the driver reads the
    throughput, the backlog and how many samples a served step holds. A Keras callback,
    made lazily so that importing this module needs no Keras."""

    def __new__(cls, workdir: str):
        import keras

        from kvcoll.keras import engine_of

        class Progress(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                eng = engine_of(self.model)
                self.eng, self.samples = eng, 0
                self.file = open(os.path.join(workdir, f"progress.r{eng.comm.rank}.log"), "a")

            def on_train_batch_end(self, b, logs=None):
                now = time.time()
                self.samples += self.eng.last_samples
                self.file.write(f"{self.eng.step} {self.samples} {now:.3f}\n")
                self.file.flush()

            def on_train_end(self, logs=None):
                self.file.close()

        return Progress()


def read_progress(workdir: str, ranks: int) -> Progress:
    """What the ranks' progress logs say now (see _Progress)."""
    logs = []
    for r in range(ranks):
        try:
            with open(os.path.join(workdir, f"progress.r{r}.log")) as f:
                text = f.read()
        except OSError:
            text = ""
        lines = text.splitlines()
        if lines and not text.endswith("\n"):
            lines = lines[:-1]                    # a line being written
        a = np.array([[float(x) for x in ln.split()] for ln in lines if ln.strip()],
                     np.float64).reshape(-1, 3)
        logs.append(a)
    return Progress(logs)


class Progress:
    """The training job's progress from its ranks' logs: samples trained by step S
    (every rank's own, summed), the newest step, the samples so far."""

    def __init__(self, logs: list):
        self.logs = logs

    @property
    def step(self) -> int:
        return int(min((a[-1, 0] for a in self.logs if a.size), default=0))

    @property
    def samples(self) -> int:
        return int(sum(a[-1, 1] for a in self.logs if a.size))

    def samples_at(self, step: int) -> int:
        """Samples of every rank trained in steps 1..step (those the rank has logged)."""
        out = 0
        for a in self.logs:
            if a.size:
                i = np.searchsorted(a[:, 0], step, side="right")
                out += int(a[i - 1, 1]) if i else 0
        return out

    def rate(self, t0: float, t1: float) -> float:
        """Samples per second trained between wall times t0 and t1 (every rank)."""
        total = 0.0
        for a in self.logs:
            if a.size:
                total += np.interp(t1, a[:, 2], a[:, 1]) - np.interp(t0, a[:, 2], a[:, 1])
        return total / max(1e-9, t1 - t0)


# ---- the processes: training job and server ------------------------------------------------

READY = re.compile(r"ready model=(\S+) version=(\d+) grpc=(\S+) rest=(\S+)")


def _env() -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if os.geteuid() == 0:  # Open MPI refuses root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


class Cluster:
    """The processes of one online run: the training job (mpirun, `ranks` ranks) and
    `kvcoll serve`, each in a session of its own, their output in workdir/*.log. Use it
    as a context manager: leaving it stops whatever is still running, the training job
    gracefully first (SIGUSR2, which mpirun relays: every rank stops after the same
    step), then SIGTERM and SIGKILL to what does not end in time."""

    def __init__(self, workdir: str, train_args: list, ranks: int = 2):
        self.workdir, self.train_args, self.ranks = workdir, list(train_args), ranks
        self.trainer = self.server = None
        self.grpc = self.rest = None
        self._logs = []

    def _popen(self, cmd, log_name):
        log = open(os.path.join(self.workdir, log_name), "w")
        self._logs.append(log)
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                cwd=ROOT, start_new_session=True)

    def start_training(self) -> None:
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        if not os.path.exists(mpirun):
            mpirun = shutil.which("mpirun") or "mpirun"
        cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(self.ranks),
               sys.executable, os.path.abspath(__file__), "--role", "train",
               "--workdir", self.workdir, *self.train_args]
        self.trainer = self._popen(cmd, "train.log")

    def start_server(self, timeout: float = 300.0, poll_ms: int = 200,
                     publish_dir: str | None = None) -> None:
        """kvcoll serve on the publish directory (workdir/publish unless given; once a
        version is there), on ports it picks; returns when it says it is ready."""
        pub = publish_dir or os.path.join(self.workdir, "publish")
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(pub, "latest")):
            self.check("waiting for the first published version")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no version was published in {pub} within {timeout:.0f} s"
                                   f"{self.tail('train.log')}")
            time.sleep(0.2)
        cmd = [sys.executable, "-m", "kvcoll.serve", pub, "--grpc-port", "0", "--rest-port",
               "0", "--poll-ms", str(poll_ms)]
        self.server = self._popen(cmd, "serve.log")
        path = os.path.join(self.workdir, "serve.log")
        while True:
            with open(path) as f:
                m = READY.search(f.read())
            if m:
                self.grpc, self.rest = m.group(3), "http://" + m.group(4)
                return
            self.check("waiting for kvcoll serve to be ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvcoll serve was not ready within {timeout:.0f} s"
                                   f"{self.tail('serve.log')}")
            time.sleep(0.2)

    def tail(self, name: str, lines: int = 25) -> str:
        try:
            with open(os.path.join(self.workdir, name)) as f:
                got = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- the end of {name} ---\n" + "\n".join(got)

    def check(self, doing: str) -> None:
        """Raise if a process ended while it should run."""
        for proc, name in ((self.trainer, "train.log"), (self.server, "serve.log")):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name[:-4]} ended (exit {proc.returncode}) while "
                                   f"{doing}{self.tail(name)}")

    def progress(self) -> Progress:
        return read_progress(self.workdir, self.ranks)

    def stop_training(self, timeout: float = 120.0) -> int | None:
        """Ask the job to stop (SIGUSR2 through mpirun) and wait; kill it if it does not
        end in time. Returns its exit code (None if it was never started)."""
        p = self.trainer
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR2)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_group(p)
        return p.returncode

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(20)
            except subprocess.TimeoutExpired:
                _kill_group(self.server)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        below = [c for p in (self.trainer, self.server) if p is not None
                 for c in descendants(p.pid)]
        try:
            self.stop_training(timeout=60.0)
        finally:
            self.stop_server()
            for p in (self.trainer, self.server):  # nothing of theirs outlives us
                if p is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
            for pid, start in below:                 # the ranks, in groups of their own
                _kill_if_same(pid, start)
            for f in self._logs:
                f.close()
        return False


def _stat(pid) -> list | None:
    """The fields of /proc/<pid>/stat after the command name (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def descendants(pid: int) -> list:
    """(pid, start time) of every process below `pid` (mpirun's ranks have process
    groups of their own, so a signal to mpirun's group does not reach them)."""
    children = {}
    for d in os.listdir("/proc"):
        st = _stat(d) if d.isdigit() else None
        if st is not None:
            children.setdefault(int(st[1]), []).append((int(d), st[19]))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c[0])
    return out


def _kill_if_same(pid: int, start: str) -> None:
    """SIGKILL a process we started, if it is still that one (not a reused pid)."""
    st = _stat(pid)
    if st is not None and st[19] == start and st[0] != "Z":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        try:
            p.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


# ---- the client ----------------------------------------------------------------------------

class Client:
    """TensorFlow Serving's gRPC API (PredictionService) and kvcoll serve's REST status."""

    def __init__(self, grpc_target: str, rest_url: str, name: str = "model"):
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        self.rest, self.name = rest_url, name
        self.channel = grpc.insecure_channel(grpc_target)
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)

    def predict(self, columns: dict, timeout: float = 60.0) -> tuple[np.ndarray, int]:
        """The served logits of samples (user, item, cat) and the version that computed
        them."""
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2

        req = predict_pb2.PredictRequest()
        req.model_spec.name = self.name
        for k in ("user", "item", "cat"):
            req.inputs[k].CopyFrom(tf.make_tensor_proto(np.asarray(columns[k], np.int64)))
        resp = self.stub.Predict(req, timeout=timeout)
        out = tf.make_ndarray(next(iter(resp.outputs.values())))
        return out.reshape(-1), resp.model_spec.version.value

    def status(self, timeout: float = 10.0) -> dict:
        """kvcoll serve's status: version, step, freshness_s, rows, applied, refused."""
        import urllib.request

        with urllib.request.urlopen(f"{self.rest}/v1/models/{self.name}",
                                    timeout=timeout) as r:
            return json.loads(r.read())["kvcoll"]

    def close(self) -> None:
        self.channel.close()


class Frozen:
    """The model as published at one version, in this process, never updated: the same
    serving code as kvcoll serve (kvcoll.serve.model.ServedModel) without following new
    versions."""

    def __init__(self, publish_dir: str):
        from kvcoll.serve.model import ServedModel

        self.model = ServedModel(publish_dir, max_batch=1 << 20)
        self.version = self.model.version
        self.step = self.model.status()["step"]
        self.model.lease.release()   # it reads nothing more from the directory

    def predict(self, columns: dict) -> np.ndarray:
        batch = self.model.sig.check({k: np.asarray(columns[k], np.int64)
                                      for k in ("user", "item", "cat")})
        out, _ = self.model.predict(batch)
        return next(iter(out.values())).reshape(-1)

    def close(self) -> None:
        self.model.close()


# ---- the driver ----------------------------------------------------------------------------

def _auc(labels, scores) -> float:
    from kvcoll.data import auc

    return auc(labels, scores)


class Schedule:
    """Which file lands when: `files_per_hour` files an hour, an hour every
    `hour_seconds` of wall time; file k covers hours [k / fph, (k + 1) / fph) and holds
    `rows` samples (a whole number of global batches)."""

    def __init__(self, hours: int, hour_seconds: float, files_per_hour: int, rows: int):
        self.hours, self.hour_seconds = hours, hour_seconds
        self.fph, self.rows = files_per_hour, rows

    @property
    def files(self) -> int:
        return self.hours * self.fph

    def span(self, k: int) -> tuple[float, float]:
        return k / self.fph, (k + 1) / self.fph

    def name(self, k: int) -> tuple[str, str]:
        return f"hour={k // self.fph:03d}", f"part-{k:05d}.parquet"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--role", choices=("driver", "train"), default="driver",
                   help=argparse.SUPPRESS)
    p.add_argument("--hours", type=int, default=6, help="synthetic hours to stream")
    p.add_argument("--hour-seconds", type=float, default=15.0,
                   help="wall seconds per synthetic hour")
    p.add_argument("--files-per-hour", type=int, default=5)
    p.add_argument("--batches-per-file", type=int, default=16,
                   help="a file holds this many global batches")
    p.add_argument("--batch-size", type=int, default=1024, help="global batch")
    p.add_argument("--eval-rows", type=int, default=4096,
                   help="held-out samples scored per file")
    p.add_argument("--publish-every", type=float, default=5.0,
                   help="kv.callbacks.Publish(every_seconds=...)")
    p.add_argument("--base-every", type=int, default=20, help="a full base every N versions")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--evict-after-steps", type=int, default=160,
                   help="evict item rows not trained for this many steps (0: never)")
    p.add_argument("--settle", type=float, default=1.0, help="kv.data.stream(settle=...)")
    p.add_argument("--ranks", type=int, default=2, help="training ranks")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sparse-lr", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="where the landing, publish and checkpoint directories go "
                   "(default: a temporary directory, removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--plot", default="online.png", help="the PNG to write")
    p.add_argument("--metrics-out", help="write the run's numbers as JSON here")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up (stopping everything) after this many seconds")
    args = p.parse_args(argv)
    for name in ("hours", "files_per_hour", "batches_per_file", "batch_size", "eval_rows",
                 "ranks", "steps_per_epoch", "checkpoint_every", "base_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hours < 2:
        p.error("--hours must be >= 2: the first hour trains the frozen model")
    if not args.hour_seconds > 0 or not args.publish_every > 0:
        p.error("--hour-seconds and --publish-every must be > 0")
    return args


def train_flags(args) -> list:
    """The driver's flags the training job needs."""
    out = []
    for name in ("batch_size", "publish_every", "base_every", "checkpoint_every",
                 "steps_per_epoch", "settle", "dim", "hidden", "lr", "sparse_lr", "seed",
                 "evict_after_steps"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


class _Stop(Exception):
    """SIGINT or SIGTERM reached the driver: it stops everything it started."""


class _Signals:
    """SIGINT and SIGTERM raise _Stop in the main thread, once: a second one during the
    clean-up is ignored so that the clean-up finishes."""

    def __enter__(self):
        self.seen = False
        self.prev = {sig: signal.signal(sig, self._on) for sig in (signal.SIGTERM,
                                                                    signal.SIGINT)}
        return self

    def _on(self, signum, frame):
        if not self.seen:
            self.seen = True
            raise _Stop(f"stopped by signal {signum}")

    def __exit__(self, *exc):
        for sig, handler in self.prev.items():
            signal.signal(sig, handler)
        return False


def drive(args) -> dict:
    """The whole run (see the module docstring); returns its numbers."""
    made = args.workdir is None
    work = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="kvcoll-online-"))
    os.makedirs(work, exist_ok=True)
    if os.listdir(work):
        raise SystemExit(f"--workdir {work} is not empty: give an empty or new directory "
                         "(the demo lands its own stream there)")
    gen = DriftingClicks(seed=args.seed)
    sched = Schedule(args.hours, args.hour_seconds, args.files_per_hour,
                     args.batches_per_file * args.batch_size)
    landing, pub = os.path.join(work, "landing"), os.path.join(work, "publish")
    print(f"online demo in {work}: {args.hours} hours of {args.hour_seconds:g} s, "
          f"{sched.fph} files an hour of {sched.rows:,} samples, {args.ranks} training "
          f"ranks publishing every {args.publish_every:g} s, one kvcoll serve", flush=True)
    landed: queue.Queue = queue.Queue()
    stop = threading.Event()
    errors = []
    t_begin = time.monotonic()
    results = {"hours": [], "freshness": [], "files": [], "workdir": work,
               "settings": {k: v for k, v in vars(args).items() if k != "role"}}

    def write_file(k):
        part, name = sched.name(k)
        cols = gen.samples(*sched.span(k), sched.rows, stream=0)
        land(os.path.join(landing, part), name, cols)
        return time.time()

    def feeder(start_at):
        try:
            for k in range(1, sched.files):
                due = start_at + k * sched.hour_seconds / sched.fph
                while not stop.is_set() and time.monotonic() < due:
                    time.sleep(min(0.05, max(0.0, due - time.monotonic())))
                if stop.is_set():
                    return
                landed.put((k, write_file(k)))
        except Exception as exc:  # noqa: BLE001 - the driver raises it
            errors.append(exc)
        finally:
            landed.put(None)

    cluster = Cluster(work, train_flags(args), ranks=args.ranks)
    client = frozen = feed = None
    try:
        with _Signals(), cluster:
            landed_at = {0: write_file(0)}
            cluster.start_training()
            cluster.start_server()
            client = Client(cluster.grpc, cluster.rest)
            t0 = time.monotonic()
            print(f"kvcoll serve is ready, {t0 - t_begin:.0f} s after the start (gRPC "
                  f"{cluster.grpc}, REST {cluster.rest}); landing a file every "
                  f"{sched.hour_seconds / sched.fph:.1f} s", flush=True)
            print(f"processes: training job (mpirun) group {cluster.trainer.pid}, kvcoll "
                  f"serve group {cluster.server.pid}; logs in {work}", flush=True)
            feed = threading.Thread(target=feeder, args=(t0,), daemon=True)
            feed.start()
            hours = {}          # hour -> {"eval": [...], "served": [...]}
            reported = set()
            todo = [0]          # landed files not scored yet
            done, last_status = False, 0.0
            while not done:
                if time.monotonic() - t_begin > args.timeout:
                    raise TimeoutError(f"the demo did not finish within --timeout "
                                       f"{args.timeout:.0f} s")
                cluster.check("streaming")
                try:
                    item = landed.get(timeout=0.25)
                    if item is None:
                        done = True
                    else:
                        landed_at[item[0]] = item[1]
                        todo.append(item[0])
                except queue.Empty:
                    pass
                now = time.monotonic()
                if now - last_status >= 1.0:
                    last_status = now
                    st, prog = client.status(), cluster.progress()
                    served = prog.samples_at(st["step"])
                    waiting = served // sched.rows      # the oldest file not all served
                    results["freshness"].append({
                        "t": now - t0, "freshness_s": st["freshness_s"],
                        "unserved_age_s": time.time() - landed_at[waiting]
                        if waiting in landed_at else 0.0,
                        "version": st["version"], "step": st["step"],
                        "landed_samples": len(landed_at) * sched.rows,
                        "trained_samples": prog.samples, "served_samples": served})
                    if frozen is None and served >= sched.fph * sched.rows:
                        # the whole first hour is in the served version: freeze it
                        frozen = Frozen(pub)
                        print(f"froze the model of the first hour: version "
                              f"{frozen.version} (step {frozen.step})", flush=True)
                for k in todo:   # the newest data, as it lands: its held-out samples
                    ev = gen.samples(*sched.span(k), args.eval_rows, stream=1)
                    scores, version = client.predict(ev)
                    h = hours.setdefault(k // sched.fph, {"eval": [], "served": []})
                    h["eval"].append(ev)
                    h["served"].append(scores)
                    results["files"].append({"file": k, "hour": k // sched.fph,
                                             "version": version, "t": time.monotonic() - t0,
                                             "landed": landed_at[k]})
                todo = []
                newest = max(hours)
                for hour in sorted(hours):   # finished hours (the frozen model may lag)
                    if hour in reported or (hour == newest and not done) or \
                            (hour >= 1 and frozen is None):
                        continue
                    _report_hour(hour, hours[hour], frozen, results)
                    reported.add(hour)
            if errors:
                raise errors[0]
            # let the last files be trained and served, then stop
            total, deadline = sched.files * sched.rows, time.monotonic() + 120
            while time.monotonic() < deadline:
                cluster.check("finishing")
                if cluster.progress().samples_at(client.status()["step"]) >= total:
                    break
                time.sleep(0.5)
            for hour in sorted(set(hours) - reported):
                if hour == 0 or frozen is not None:
                    _report_hour(hour, hours[hour], frozen, results)
            code = cluster.stop_training()
            results["train_exit"] = code
            results["final_status"] = client.status()
            results["trained_samples"] = cluster.progress().samples
            results["landed_samples"] = total
            if code != 0:
                raise RuntimeError(f"the training job ended with exit code {code}"
                                   f"{cluster.tail('train.log')}")
        results["seconds"] = time.monotonic() - t_begin
    finally:
        stop.set()
        if feed is not None:
            feed.join(30)
        if client is not None:
            client.close()
        if frozen is not None:
            frozen.close()
        if made and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _report_hour(hour: int, h: dict, frozen, results: dict) -> None:
    """One hour's line: the served and frozen models' AUC on its held-out samples."""
    ev = {k: np.concatenate([e[k] for e in h["eval"]]) for k in h["eval"][0]}
    labels = ev["click"]
    row = {"hour": hour, "samples": int(labels.size),
           "served_auc": _auc(labels, np.concatenate(h["served"])),
           "planted_auc": _auc(labels, ev["logit"])}
    if frozen is not None and hour >= 1:
        row["frozen_auc"] = _auc(labels, frozen.predict(ev))
    files = [f for f in results["files"] if f["hour"] == hour]
    t0, t1 = files[0]["t"], files[-1]["t"]
    fresh = [f["freshness_s"] for f in results["freshness"] if t0 <= f["t"] <= t1 + 1.0]
    row.update(t_begin=t0, t_end=t1, versions=[files[0]["version"], files[-1]["version"]],
               freshness_mean_s=float(np.mean(fresh)) if fresh else None,
               freshness_max_s=float(np.max(fresh)) if fresh else None)
    results["hours"].append(row)
    frozen_s = f"frozen {row['frozen_auc']:.4f}" if "frozen_auc" in row else \
        "frozen    -   "
    lag = "" if not fresh else (f"   freshness lag mean {row['freshness_mean_s']:4.1f} s, "
                                f"max {row['freshness_max_s']:4.1f} s")
    print(f"hour {hour}: AUC served {row['served_auc']:.4f}   {frozen_s}   best possible "
          f"{row['planted_auc']:.4f}   (versions {row['versions'][0]}-{row['versions'][1]})"
          f"{lag}", flush=True)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = results["hours"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    xs = [h["hour"] for h in hours]
    a.plot(xs, [h["served_auc"] for h in hours], "o-", label="served (kvcoll serve, live)")
    fz = [(h["hour"], h["frozen_auc"]) for h in hours if "frozen_auc" in h]
    if fz:
        a.plot(*zip(*fz), "s-", label="frozen at the end of hour 0")
    a.plot(xs, [h["planted_auc"] for h in hours], "k--", lw=1, label="best possible (planted)")
    a.set_xticks(xs)
    a.set_xlabel("hour of the stream")
    a.set_ylabel("AUC on the newest data")
    a.set_title("Scoring each new hour's data")
    a.legend(fontsize=8)
    f = results["freshness"]
    b.plot([x["t"] for x in f], [x["freshness_s"] for x in f], "-", lw=1.2,
           label="served version's age (its training step's time)")
    b.plot([x["t"] for x in f], [x["unserved_age_s"] for x in f], "--", lw=1,
           label="oldest landed sample not served yet")
    b.legend(fontsize=8)
    for h in hours:
        b.axvline(h["t_begin"], color="grey", lw=0.5, ls=":")
    b.set_xlabel("seconds since serving began")
    b.set_ylabel("freshness lag (s)")
    b.set_title("Freshness lag")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "train":
        return train(args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        results = drive(args)
    except _Stop as exc:
        print(f"online demo: {exc}; every process it started is stopped", flush=True)
        return 130
    late = [h for h in results["hours"] if "frozen_auc" in h]
    if late:
        gain = np.mean([h["served_auc"] - h["frozen_auc"] for h in late])
        fresh = [x["freshness_s"] for x in results["freshness"]]
        print(f"served vs frozen over hours 1-{late[-1]['hour']}: AUC +{gain:.4f} on "
              f"average; freshness lag median {np.median(fresh):.1f} s, max "
              f"{np.max(fresh):.1f} s; {results['seconds']:.0f} s in all", flush=True)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}", flush=True)
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
