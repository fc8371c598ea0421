"""Online learning: freshness of served rows, the cost of a publish, serving, memory.

    python -m bench online            # the whole benchmark: about 20 minutes
    python -m bench online --quick    # a smoke test: a few minutes, small sizes

What it measures (issue 31), each part interleaved with what it is compared to:

- Freshness: 2 training ranks (examples/online.py's training job: model.fit on
  kv.data.stream, kv.callbacks.Publish every 5, 10 and 30 s) and one kvcoll serve on
  this machine. First the job's throughput with a backlog (files landed at once), then
  files land at half that rate; some carry a probe: an item id never seen before.
  Freshness is the time from the probe file landing (its ctime, the arrival time the
  stream orders by) to the first served prediction that uses the probe's trained row:
  a client asks every 0.1 s for the probe and for an id never seen in one request, and
  the two differ exactly when the served version holds a row for the probe (unknown
  ids read zeros), which only a committed training step creates. Each detection is
  checked against the publish directory: the response's version must be the first
  published version that holds the probe's row. Reported: p50, p95, max over >= 10
  probes per interval, the backlog (landed, not yet trained), and the training
  throughput with a backlog at each interval against a run that publishes only at its
  start (run before and after the others), with the share of the step time that went
  to publishing.
- Publish cost: one table of 10M rows (dim 16), 1% of its rows changed, then a delta
  (kvcoll.publish.Publisher) against a full publish of every row, alternated; the
  dense model's write (the serving graph, once; its weights) is timed apart.
- Serving: requests/s and p50/p99 latency at batch 1 and 256 over gRPC and REST (a
  load process with 8 requests in flight, the configurations alternated); in process,
  the server's request path (ServedModel: check, lookups, graph) against kv.export's
  SavedModel through tf.saved_model.load on the same inputs, alternated; p99 while
  deltas apply (one every second, 2% of the rows each) against quiet windows,
  alternated, with 2 requests in flight and as an open loop at a fixed rate.
- Memory: the RSS per row of a server (ServedModel) and of kv.export's SavedModel
  loaded with tf.saved_model.load, from the difference between two table sizes (so
  what TensorFlow and the graph take once cancels out).

The machine is shared: each part notes how busy the rest of the machine was (CPU
cores' worth of other processes, from /proc). Writes bench/results/online.json,
online.md and online.png (and online-latencies.json, every request's latency: not
committed).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from . import common

sys.path.insert(0, os.path.join(common.ROOT, "examples"))

TARGET_P95_S = 15.0
TARGET_PUBLISH_RATIO = 20.0
TARGET_INPROC = 1.0
TARGET_DELTA_P99 = 1.2


def add_arguments(p) -> None:
    g = p.add_argument_group("online")
    g.add_argument("--online-intervals", default="5,10,30",
                   help="publish intervals (s) for the freshness runs, the first one is "
                        "the headline")
    g.add_argument("--online-probes", type=int, default=12, help="probes per interval")
    g.add_argument("--online-publish-rows", type=int, default=10_000_000,
                   help="table rows for the publish cost")
    g.add_argument("--online-serve-rows", type=int, default=1_000_000,
                   help="item rows of the served model")
    g.add_argument("--online-parts", default="publish,inproc,load,memory,freshness",
                   help="which parts to run (comma-separated)")


# -- the machine's other load ------------------------------------------------------------------

class Load:
    """CPU cores' worth used by processes that are not ours (this process and every
    process it started, their children included: mpirun's ranks have process groups of
    their own), averaged over the time between start() and stop()."""

    @staticmethod
    def _total():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]) - v[3] - v[4]

    @staticmethod
    def _ours():
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            # utime, stime and those of its children it has reaped (a process that
            # ended during the window is counted in its parent's)
            procs[int(d)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
        me, ticks = os.getpid(), 0
        for pid, (ppid, t) in procs.items():
            p, seen = pid, 0
            while p and p != me and seen < 64:      # an ancestor of it is this process
                p, seen = procs.get(p, (0, 0))[0], seen + 1
            if p == me:
                ticks += t
        return ticks

    def start(self):
        self.t0, self.b0, self.o0 = time.monotonic(), self._total(), self._ours()
        return self

    def stop(self) -> float:
        dt = time.monotonic() - self.t0
        hz = os.sysconf("SC_CLK_TCK")
        others = (self._total() - self.b0) - (self._ours() - self.o0)
        return max(0.0, others / hz / max(dt, 1e-9))


# -- publish cost (a child process) ------------------------------------------------------------

def publish_child(spec: dict) -> None:
    """10M rows, 1% changed, a delta against a full publish, alternated."""
    from kvcoll import optimizers
    from kvcoll.comm import Comm
    from kvcoll.publish import Publisher
    from kvcoll.table import KvTable

    rows, dim, reps = spec["rows"], spec["dim"], spec["reps"]
    rng = np.random.default_rng(0)
    t = KvTable(dim, name="t", optimizer=optimizers.SGD(0.01), initial_capacity=rows)
    chunk = 1 << 20
    t0 = time.perf_counter()
    for s in range(0, rows, chunk):
        keys = np.arange(s, min(rows, s + chunk), dtype=np.int64) * 2654435761 % (1 << 62)
        t.update(keys, rng.standard_normal((keys.size, dim), np.float32))
    fill = time.perf_counter() - t0
    all_keys = np.arange(rows, dtype=np.int64) * 2654435761 % (1 << 62)
    comm = Comm.local()
    root = spec["dir"]
    chain = Publisher({"t": t}, comm, base_every=10**6, keep_bases=1)
    chain.publish(os.path.join(root, "chain"), 0)                    # the chain's base
    for rep in range(reps):
        changed = rng.choice(all_keys, rows // 100, replace=False)
        t.update(changed, rng.standard_normal((changed.size, dim), np.float32))
        d = chain.publish(os.path.join(root, "chain"), rep + 1)
        assert d.kinds == ("delta",), d
        emit = {"part": "publish", "kind": "delta", "rep": rep, "rows": int(d.rows),
                "table_rows": rows, "dim": dim, "seconds": d.seconds, "bytes": d.bytes,
                "fill_seconds": fill}
        common.emit(emit)
        full_dir = os.path.join(root, f"full-{rep}")
        f = Publisher({"t": t}, comm).publish(full_dir, 1)            # every row: a base
        assert f.kinds == ("base",), f
        common.emit({"part": "publish", "kind": "full", "rep": rep, "rows": int(f.rows),
                     "table_rows": rows, "dim": dim, "seconds": f.seconds, "bytes": f.bytes})
        shutil.rmtree(full_dir, ignore_errors=True)


# -- the served model: set up, load, in-process, memory (child processes) ---------------------

def _model_with_rows(items: int, dim: int, seed: int = 0):
    """examples/online.py's model on one process, its tables filled with `items` item
    rows (and every user and category), the dense part given random weights."""
    import keras

    from kvcoll.comm import Comm
    from kvcoll.keras import engine_of
    from kvcoll.keras.saving import engine_for
    from online import DriftingClicks, build_model

    import kvcoll as kv

    keras.utils.set_random_seed(seed)
    model = build_model(dim, 32)
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    eng = engine_for(model)
    gen = DriftingClicks(seed=seed)
    rng = np.random.default_rng(seed)
    keys = {"user": np.arange(gen.users, dtype=np.int64),
            "item": np.arange(items, dtype=np.int64),
            "cat": np.arange(gen.categories, dtype=np.int64)}
    for name, k in keys.items():
        for s in range(0, k.size, 1 << 20):
            part = k[s:s + (1 << 20)]
            eng.tables[name].update(part, 0.1 * rng.standard_normal((part.size, dim),
                                                                     np.float32))
    return model, eng, keys


def setup_child(spec: dict) -> None:
    """A served model's directories: publish/ (a base at version 1; with deltas > 0,
    that many deltas of 2% of the item rows each, moved to stage/ so that a server
    starts at version 1 and the load test releases them) and export/ (kv.export of
    version 1)."""
    import kvcoll as kv
    from kvcoll import _shards
    from kvcoll.keras.serving_graph import ServingDense
    from kvcoll.publish import Publisher, version_dir

    model, eng, keys = _model_with_rows(spec["items"], spec["dim"])
    root = spec["dir"]
    dense = ServingDense(eng)
    pub = Publisher(eng.tables, eng.comm, dense, base_every=10**6, keep_bases=2)
    info = pub.publish(os.path.join(root, "publish"), 1)
    t0 = time.perf_counter()     # the export holds version 1, as a server starts with
    kv.export(os.path.join(root, "export"), model, dictionary=False)
    export_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    item = eng.tables["item"]
    for v in range(spec["deltas"]):
        k = rng.choice(keys["item"], max(1, keys["item"].size // 50), replace=False)
        item.update(k, 0.1 * rng.standard_normal((k.size, spec["dim"]), np.float32))
        for w in model.trainable_variables[-2:]:          # the dense weights move too
            w.assign(w.numpy() + np.float32(1e-3))
        pub.publish(os.path.join(root, "publish"), 2 + v)
    if spec["deltas"]:
        os.makedirs(os.path.join(root, "stage"), exist_ok=True)
        for v in range(2, 2 + spec["deltas"]):
            name = version_dir("delta", v)
            os.rename(os.path.join(root, "publish", name), os.path.join(root, "stage", name))
        with open(os.path.join(root, "publish", "latest"), "w") as f:
            f.write("1\n")
    # the dense model's write, apart: the serving graph (written once per Publisher)
    # and the weights (each version whose dense weights changed)
    graph_s, weights_s = [], []
    weights = dense.weights()
    for i in range(3):
        t0 = time.perf_counter()
        dense.write_graph(os.path.join(root, f"graph-{i}", "saved_model"))
        graph_s.append(time.perf_counter() - t0)
        shutil.rmtree(os.path.join(root, f"graph-{i}"))
        t0 = time.perf_counter()
        _, nbytes = _shards.write_shard_v1(os.path.join(root, f"dense-{i}.kvw"), weights)
        weights_s.append(time.perf_counter() - t0)
        os.remove(os.path.join(root, f"dense-{i}.kvw"))
    common.emit({"part": "setup", "rows": {n: int(len(t)) for n, t in eng.tables.items()},
                 "base_seconds": info.seconds, "export_seconds": export_s,
                 "dense_params": int(sum(w.size for w in weights)), "dense_bytes": nbytes,
                 "graph_write_s": statistics.median(graph_s),
                 "weights_write_s": statistics.median(weights_s)})


def _inputs(keys: dict, n: int, rng) -> dict:
    """A batch of n samples of known ids (1 in 16 item ids unknown, as live traffic)."""
    item = rng.choice(keys["item"], n)
    item[rng.random(n) < 1 / 16] += 1 << 40
    return {"user": rng.choice(keys["user"], n), "item": item,
            "cat": rng.choice(keys["cat"], n)}


def _keys_of(setup: dict) -> dict:
    return {n: np.arange(r, dtype=np.int64) for n, r in setup["rows"].items()}


def inproc_child(spec: dict) -> None:
    """The server's request path without the network against kv.export's SavedModel,
    same inputs, alternated."""
    import tensorflow as tf

    from kvcoll.serve.model import ServedModel

    root = spec["dir"]
    served = ServedModel(os.path.join(root, "publish"), max_batch=1 << 16)
    saved = tf.saved_model.load(os.path.join(root, "export", "saved_model"))
    fn = saved.signatures["serving_default"]
    rng = np.random.default_rng(2)
    keys = _keys_of(spec["setup"])
    for batch in spec["batches"]:
        inputs = [_inputs(keys, batch, rng) for _ in range(16)]
        # the same predictions (up to float rounding) on the same inputs
        a = next(iter(served.predict(served.sig.check(inputs[0]))[0].values()))
        b = next(iter(fn(**{k: tf.constant(v) for k, v in inputs[0].items()}).values()))
        diff = float(np.max(np.abs(a.reshape(-1) - b.numpy().reshape(-1))))

        def server_path(i):
            served.predict(served.sig.check(inputs[i % 16]))

        def savedmodel(i):
            fn(**{k: tf.constant(v) for k, v in inputs[i % 16].items()})

        for f in (server_path, savedmodel):       # warm-up
            for i in range(5):
                f(i)
        # short turns, alternated (and which goes first too): the machine's other load
        # falls on both alike
        wall = {"server": [], "savedmodel": []}
        cpu = {"server": [], "savedmodel": []}
        calls = 8 if batch >= 64 else 32
        end = time.perf_counter() + spec["seconds"]
        turn = 0
        while time.perf_counter() < end or turn < 4:
            pair = (("server", server_path), ("savedmodel", savedmodel))
            for name, f in (pair if turn % 2 == 0 else pair[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                for i in range(calls):
                    f(turn * calls + i)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            turn += 1
        n = calls * batch * turn
        ratios = [m / s_ for s_, m in zip(wall["server"], wall["savedmodel"])]
        common.emit({"part": "inproc", "batch": batch, "max_abs_diff": diff, "turns": turn,
                     "server_samples_per_s": n / sum(wall["server"]),
                     "savedmodel_samples_per_s": n / sum(wall["savedmodel"]),
                     "server_cpu_samples_per_s": n / sum(cpu["server"]),
                     "savedmodel_cpu_samples_per_s": n / sum(cpu["savedmodel"]),
                     "turn_ratio_median": statistics.median(ratios),
                     "turn_ratio_quartiles": [float(np.percentile(ratios, 25)),
                                              float(np.percentile(ratios, 75))]})
    served.close()


def memory_child(spec: dict) -> None:
    """RSS before and after loading one model (a server's ServedModel, or kv.export's
    SavedModel), after a first prediction."""
    import tensorflow as tf  # noqa: F401 - TensorFlow's own memory is in the baseline

    from kvcoll.serve.model import ServedModel

    keys = _keys_of(spec["setup"])
    feed = _inputs(keys, 256, np.random.default_rng(3))
    if spec["kind"] == "served":
        import kvcoll.publish  # noqa: F401
    before = common.rss_bytes()
    if spec["kind"] == "served":
        m = ServedModel(os.path.join(spec["dir"], "publish"))
        m.predict(m.sig.check(feed))
    else:
        m = tf.saved_model.load(os.path.join(spec["dir"], "export", "saved_model"))
        m.signatures["serving_default"](**{k: tf.constant(v) for k, v in feed.items()})
    after = common.rss_bytes()
    common.emit({"part": "memory", "kind": spec["kind"], "rows": sum(spec["setup"]["rows"]
                                                                        .values()),
                 "rss_before": before, "rss_after": after})


# -- serving load (a child process: 8 requests in flight) --------------------------------------

def _server_histograms(rest: str) -> dict:
    """The server's latency histograms (cumulative counts per bucket): {"request": ...
    (gRPC requests, arrival to response), "queue" / "dispatch" / "predict" / "lookup" /
    "graph": ...} as {name: [(le seconds, count), ...]}, read from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(rest + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("kvcoll_serve_request_seconds", "kvcoll_serve_stage_seconds"):
            continue
        for sample in family.samples:
            labels = sample.labels
            if not sample.name.endswith("_bucket") or labels.get("api", "grpc") != "grpc":
                continue
            out.setdefault(labels.get("stage", "request"), []).append(
                (float(labels["le"]), sample.value))
    return out


def _histogram_p(before: dict, after: dict, q: float) -> dict:
    """Per histogram, the q-th percentile (ms) of what was observed between two scrapes,
    interpolated within its bucket (None when nothing was)."""
    out = {}
    for name, buckets in after.items():
        prev = dict(before.get(name, []))
        les = [le for le, _ in buckets]
        counts = [c - prev.get(le, 0.0) for le, c in buckets]
        total = counts[-1] if counts else 0
        if not total:
            out[name] = None
            continue
        want, lo, below = q / 100 * total, 0.0, 0.0
        for le, c in zip(les, counts):
            if c >= want:
                hi = le if le != float("inf") else lo
                out[name] = 1e3 * (lo + (hi - lo) * (want - below) / max(c - below, 1e-9))
                break
            lo, below = le, c
    return out


def load_child(spec: dict) -> None:
    """Windows of load, one after another, each {"api", "batch", "seconds", "deltas"}:
    requests/s and latencies; with "deltas", a delta is released into the served
    directory every second while the window runs (moved from stage/, `latest` bumped)."""
    import aiohttp
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    rng = np.random.default_rng(4)
    keys = _keys_of(spec["setup"])
    reqs = {}
    for batch in sorted({w["batch"] for w in spec["windows"]}):
        grpc_reqs, bodies = [], []
        for _ in range(32):
            feed = _inputs(keys, batch, rng)
            r = predict_pb2.PredictRequest()
            r.model_spec.name = "model"
            for k, v in feed.items():
                r.inputs[k].CopyFrom(tf.make_tensor_proto(v))
            grpc_reqs.append(r)
            bodies.append(json.dumps({"inputs": {k: v.tolist() for k, v in feed.items()}})
                          .encode())
        reqs[batch] = (grpc_reqs, bodies)
    stage, pub = spec.get("stage"), spec.get("publish")
    staged = sorted(os.listdir(stage)) if stage else []

    def release(stop: threading.Event, out: list):
        from kvcoll.publish import version_dir
        while not stop.wait(1.0):
            if not staged:
                return
            name = staged.pop(0)
            os.rename(os.path.join(stage, name), os.path.join(pub, name))
            v = int(name.split("-")[1])
            tmp = os.path.join(pub, "latest.tmp-bench")
            with open(tmp, "w") as f:
                f.write(f"{v}\n")
            os.replace(tmp, os.path.join(pub, "latest"))
            out.append(version_dir("delta", v))

    async def run_window(w):
        grpc_reqs, bodies = reqs[w["batch"]]
        lat, errors = [], 0
        url = f"{spec['rest']}/v1/models/model:predict"

        async def paced(send, seconds, rate):
            """Open loop: request i is sent at start + i / rate whatever the answers, its
            latency counted from then (a late answer delays no later request)."""
            nonlocal errors
            start = time.perf_counter()
            tasks = []

            async def one(j, at):
                nonlocal errors
                try:
                    await send(j)
                    if seconds == w["seconds"]:
                        lat.append(time.perf_counter() - at)
                except Exception:  # noqa: BLE001 - counted
                    errors += 1

            n = int(seconds * rate)
            for j in range(n):
                at = start + j / rate
                delay = at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(j, at)))
            await asyncio.gather(*tasks)

        async def go(send, seconds):
            nonlocal errors
            if w.get("rate"):
                return await paced(send, seconds, w["rate"])
            end = time.perf_counter() + seconds

            async def worker(i):
                nonlocal errors
                j = i
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    try:
                        await send(j)
                        if seconds == w["seconds"]:
                            lat.append(time.perf_counter() - t0)
                    except Exception:  # noqa: BLE001 - counted
                        errors += 1
                    j += conc
            conc = w.get("concurrency", spec["concurrency"])
            await asyncio.gather(*(worker(i) for i in range(conc)))

        if w["api"] == "grpc":
            async with grpc.aio.insecure_channel(spec["grpc"]) as ch:
                stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)

                async def send(j):
                    await stub.Predict(grpc_reqs[j % len(grpc_reqs)], timeout=30)
                await go(send, 1.0)                          # warm-up
                t0 = time.perf_counter()
                await go(send, w["seconds"])
        else:
            async with aiohttp.ClientSession() as session:
                async def send(j):
                    async with session.post(url, data=bodies[j % len(bodies)],
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(r.status)
                await go(send, 1.0)
                t0 = time.perf_counter()
                await go(send, w["seconds"])
        return lat, errors, time.perf_counter() - t0

    from kvcoll.serve.heap import Pauses, settle

    # An open loop's sends are due at fixed times: a full collection here (measured:
    # 170-180 ms in this process, which holds TensorFlow) sent every request due
    # meanwhile late, and the lateness counted as the server's latency. What the load
    # process holds is frozen, as the server freezes its own; its full collections
    # still running are counted per window.
    settle()
    for i, w in enumerate(spec["windows"]):
        hist0 = _server_histograms(spec["rest"])  # (includes the window's warm-up second)
        pauses = Pauses()   # this load process's own full collections (it sends late)
        stop, released = threading.Event(), []
        th = None
        if w.get("deltas"):
            th = threading.Thread(target=release, args=(stop, released), daemon=True)
            th.start()
        lat, errors, seconds = asyncio.run(run_window(w))
        stop.set()
        if th is not None:
            th.join()
        pauses.close()
        server_p99 = _histogram_p(hist0, _server_histograms(spec["rest"]), 99)
        lat = np.array(lat)
        common.emit({"part": "load", "window": i, **w, "requests": int(lat.size),
                     "server_p99_ms": server_p99,
                     "client_gc_pauses": pauses.count,
                     "client_gc_ms_max": round(1000.0 * pauses.longest, 1),
                     "errors": errors, "wall_s": seconds,
                     "rps": lat.size / seconds, "samples_per_s": lat.size * w["batch"] / seconds,
                     "p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
                     "p99_ms": float(np.percentile(lat, 99) * 1e3) if lat.size else None,
                     "latencies_ms": (lat * 1e3).round(3).tolist(),
                     "released": released})


# -- freshness (examples/online.py's processes) -----------------------------------------------

def _freshness_run(root: str, interval: float | None, probes: int, quick: bool,
                   log) -> dict:
    """One training job publishing every `interval` s (None: only at its start and end)
    and one server: the throughput with a backlog, then (with an interval) probes at
    half that throughput. Returns the run's numbers."""
    import online

    work = os.path.join(root, f"fresh-{interval or 'none'}")
    os.makedirs(work)
    gen = online.DriftingClicks(seed=0)
    batch, per_file = 1024, 16
    rows = batch * per_file
    every = interval if interval is not None else 10**9
    flags = ["--batch-size", batch, "--publish-every", every, "--base-every", 10**6,
             "--checkpoint-every", 10**6, "--steps-per-epoch", 50, "--settle", 1.0,
             "--dim", 8, "--hidden", 32, "--lr", 3e-3, "--sparse-lr", 0.3, "--seed", 0,
             "--evict-after-steps", 0]
    cluster = online.Cluster(work, [str(f) for f in flags], ranks=2)
    landing = os.path.join(work, "landing")
    k = 0
    landed = {}               # file -> (ctime, rows)

    def land(probe=None):
        nonlocal k
        cols = gen.samples(k / 5, (k + 1) / 5, rows, stream=0)
        if probe is not None:                     # 64 rows of the file carry the probe
            at = np.arange(0, rows, rows // 64)
            cols["item"][at] = probe
            cols["click"][at] = 1
        path = online.land(os.path.join(landing, f"hour={k // 5:03d}"),
                           f"part-{k:05d}.parquet", cols)
        landed[k] = (os.stat(path).st_ctime_ns / 1e9, rows)
        k += 1
        return landed[k - 1][0]

    out = {"interval_s": interval}
    load = Load()
    with cluster:
        land()
        cluster.start_training()
        cluster.start_server()
        load.start()
        client = online.Client(cluster.grpc, cluster.rest)
        # 1. throughput with a backlog: files landed whenever fewer than `ahead` files
        # wait, the rate measured over `window` seconds after a warm-up
        ahead, window, warm = 8, (8.0 if quick else 20.0), 3.0
        t_begin = time.time()
        while time.time() < t_begin + warm + window:
            cluster.check("measuring the throughput")
            waiting = sum(r for _, r in landed.values()) - cluster.progress().samples
            if waiting < ahead * rows:
                land()
            else:
                time.sleep(0.05)
        t_end = time.time()
        prog = cluster.progress()
        thr = prog.rate(t_begin + warm, t_end)
        out.update(throughput=thr, measure_s=t_end - t_begin - warm)
        while sum(r for _, r in landed.values()) > cluster.progress().samples:
            cluster.check("draining the backlog")          # (before the probes)
            time.sleep(0.1)
        log(f"[online] publish {interval or 'never'}: {thr:,.0f} samples/s with a backlog")
        if interval is not None:
            out.update(_probe_phase(cluster, client, land, landed, thr, rows, interval,
                                    probes, quick, log))
        out["others_cores"] = load.stop()
        client.close()
        out["train_exit"] = cluster.stop_training()
    # the share of rank 0's time that publishing took: each version's milliseconds over
    # the time between versions (the first, a base with the serving graph, and the last,
    # at the stop, left out)
    pubs = _publishes(work)[1:-1]
    out["publishes"] = pubs
    if interval is not None and len(pubs) >= 2:
        gaps = np.diff([t for t, _ in pubs])
        out["publish_ms_mean"] = float(np.mean([ms for _, ms in pubs]))
        out["publish_gap_s_mean"] = float(np.mean(gaps))
        out["publish_share"] = out["publish_ms_mean"] / 1e3 / out["publish_gap_s_mean"]
    if interval is not None:
        _verify(os.path.join(work, "publish"), out["probes"])
    shutil.rmtree(work, ignore_errors=True)
    return out


def _publishes(work: str) -> list:
    """(wall time, milliseconds) of every version rank 0 published (train.log)."""
    import re

    out = []
    try:
        with open(os.path.join(work, "train.log"), errors="replace") as f:
            for line in f:
                m = re.search(r"published version \d+ .* (\d+) ms \[wall (\d+\.\d+)\]", line)
                if m:
                    out.append((float(m.group(2)), float(m.group(1))))
    except OSError:
        pass
    return out


def _probe_phase(cluster, client, land, landed, thr, rows, interval, probes, quick, log):
    """Files at half the throughput, probes among them; detection by a client asking
    every 0.1 s."""
    import online

    if not thr > 0:
        raise RuntimeError(f"no training throughput was measured ({thr}): see train.log")
    rate = 0.5 * thr
    gap = rows / rate                                # seconds between files
    spacing = max(3.0, interval / 5)
    every = max(1, int(round(spacing / gap)))        # a probe every `every` files
    sentinel = online.PROBE_BASE - 1                 # never in the data
    base_probe = online.PROBE_BASE + int(interval * 1000)
    pending, found, backlog = {}, {}, []
    stop = threading.Event()

    def detect():
        while not stop.is_set():
            ids = list(pending)
            if ids:
                cols = {"user": np.zeros(len(ids) + 1, np.int64),
                        "item": np.array([sentinel, *ids], np.int64),
                        "cat": np.zeros(len(ids) + 1, np.int64)}
                try:
                    pred, version = client.predict(cols, timeout=10)
                    now = time.time()
                    for i, pid in enumerate(ids):
                        if pred[i + 1] != pred[0]:
                            found[pid] = {"detected": now, "version": int(version)}
                            pending.pop(pid, None)
                except Exception as exc:  # noqa: BLE001 - tried again
                    log(f"[online] probe request failed: {exc}")
            stop.wait(0.1)

    th = threading.Thread(target=detect, daemon=True)
    th.start()
    info = {}
    t_start = time.monotonic()
    n_files, sent = 0, 0
    arrived0 = sum(r for _, r in landed.values())
    try:
        while sent < probes:
            due = t_start + n_files * gap
            while time.monotonic() < due:
                time.sleep(min(0.05, max(0.0, due - time.monotonic())))
                p = cluster.progress()
                backlog.append((time.time(), sum(r for _, r in landed.values()) - p.samples))
            cluster.check("probing")
            probe = base_probe + sent if n_files % every == every - 1 else None
            t = land(probe)
            if probe is not None:
                info[probe] = {"landed": t}
                pending[probe] = True
                sent += 1
            n_files += 1
        arrival = (sum(r for _, r in landed.values()) - arrived0) / (time.monotonic() - t_start)
        deadline = time.monotonic() + 3 * interval + 60
        while pending and time.monotonic() < deadline:   # the data keeps arriving
            due = t_start + n_files * gap
            while time.monotonic() < due:
                time.sleep(0.05)
            land()
            n_files += 1
            cluster.check("waiting for the last probes")
    finally:
        stop.set()
        th.join(15)
    res = []
    for pid, d in info.items():
        f = found.get(pid)
        res.append({"probe": pid, "landed": d["landed"],
                    "detected": f["detected"] if f else None,
                    "version": f["version"] if f else None,
                    "freshness_s": f["detected"] - d["landed"] if f else None})
    got = sorted(r["freshness_s"] for r in res if r["freshness_s"] is not None)
    b = np.array([x for _, x in backlog]) if backlog else np.zeros(1)
    log(f"[online] publish {interval:g} s: {len(got)}/{len(res)} probes seen; freshness "
        f"p50 {np.percentile(got, 50) if got else float('nan'):.1f} s, p95 "
        f"{np.percentile(got, 95) if got else float('nan'):.1f} s; arrival "
        f"{arrival:,.0f} samples/s ({arrival / thr:.0%} of the throughput), backlog max "
        f"{b.max():,.0f} samples")
    return {"probes": res, "arrival": arrival, "arrival_share": arrival / thr,
            "backlog_mean": float(b.mean()), "backlog_max": float(b.max()),
            "backlog_max_s": float(b.max() / thr), "file_gap_s": gap,
            "backlog_trace": [(round(t, 2), int(x)) for t, x in backlog[::4]]}


def _verify(pub: str, probes: list) -> None:
    """Per probe: the first published version that holds its row (and its manifest's
    wall time); whether the detection saw exactly that version."""
    from kvcoll.publish import list_versions, load_version, read_manifest

    want = {p["probe"] for p in probes}
    first = {}
    got = list_versions(pub)
    for v in sorted(set(got["delta"]) | set(got["base"])):
        kind = "delta" if v in got["delta"] else "base"
        loaded = load_version(pub, kind, v)
        keys = set(loaded["tables"]["item"]["keys"].tolist()) & (want - set(first))
        wall = read_manifest(pub, kind, v)["wall_time"]
        for key in keys:
            first[key] = (v, wall)
    for p in probes:
        v = first.get(p["probe"])
        p["first_version"], p["published"] = (v[0], v[1]) if v else (None, None)
        p["exact"] = v is not None and p["version"] == v[0]
        if v and p["detected"]:
            p["land_to_published_s"] = v[1] - p["landed"]
            p["published_to_served_s"] = p["detected"] - v[1]


# -- the driver ----------------------------------------------------------------------------

def run(args) -> None:
    quick = args.quick
    out_dir = args.out or (tempfile.mkdtemp() if quick else common.RESULTS)
    parts = set(args.online_parts.split(","))
    known = {"publish", "inproc", "load", "memory", "freshness"}
    if parts - known:
        raise SystemExit(f"--online-parts: unknown part(s) {sorted(parts - known)}; "
                         f"choose from {sorted(known)} (comma-separated)")
    intervals = [float(x) for x in args.online_intervals.split(",")]
    if quick:
        intervals = intervals[:1]
    probes = 4 if quick else max(10, args.online_probes)
    res = {"publish_interval_s": intervals[0], "quick": quick}
    root = tempfile.mkdtemp(prefix="kvbench-online-", dir=os.environ.get("KVBENCH_TMP"))

    def log(msg):
        print(msg, flush=True)

    def on_term(signum, frame):   # the clean-up below (and every Cluster's) runs
        raise SystemExit(f"[online] stopped by signal {signum}")

    prev = signal.signal(signal.SIGTERM, on_term)
    try:
        res["idle_others_cores"] = common.busy_cores(2.0)
        if "publish" in parts:
            res["publish"] = _publish_part(root, quick, args, log)
        if parts & {"inproc", "load", "memory"}:
            res.update(_serving_part(root, quick, args, parts, log))
        if "freshness" in parts:
            res["freshness"] = _freshness_part(root, intervals, probes, quick, log)
            head = res["freshness"]["runs"].get(str(intervals[0]))
            if head and head.get("p50") is not None:
                res["freshness_s"] = {"p50": head["p50"], "p95": head["p95"]}
    finally:
        signal.signal(signal.SIGTERM, prev)
        shutil.rmtree(root, ignore_errors=True)
    res["machine"] = common.machine_info()
    md = markdown(res)
    # every request's latency (megabytes) goes to a file of its own, not committed
    # (.gitignore): online.json keeps the numbers of the tables and the machine
    raw = [{"window": r["window"], "phase": r.get("phase"), "api": r["api"],
            "batch": r["batch"], "deltas": r["deltas"],
            "latencies_ms": r.pop("latencies_ms")}
           for r in res.get("serving", {}).get("load", {}).get("records", [])
           if "latencies_ms" in r]
    if raw:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "online-latencies.json"), "w") as f:
            json.dump(raw, f)
    jpath, mpath = common.write_results(out_dir, "online", res, md)
    _plot(res, os.path.join(out_dir, "online.png"))
    print(md)
    print(f"[online] wrote {jpath}, {mpath}, {os.path.join(out_dir, 'online.png')}")


def _publish_part(root, quick, args, log) -> dict:
    rows = 1_000_000 if quick else args.online_publish_rows
    log(f"[online] publish cost: a {rows:,}-row table, 1% changed: delta vs full")
    load = Load().start()
    recs, err = common.run_child("bench.online_bench:publish_child",
                                 {"rows": rows, "dim": 16, "reps": 2 if quick else 3,
                                  "dir": os.path.join(root, "pubcost")}, timeout=3600)
    shutil.rmtree(os.path.join(root, "pubcost"), ignore_errors=True)
    out = {"records": recs, "error": err, "others_cores": load.stop()}
    d = [r["seconds"] for r in recs if r["kind"] == "delta"]
    f = [r["seconds"] for r in recs if r["kind"] == "full"]
    if d and f:
        out.update(table_rows=rows, delta_s=statistics.median(d), full_s=statistics.median(f),
                   ratio=statistics.median(f) / statistics.median(d),
                   pair_ratios=[b / a for a, b in zip(d, f)],
                   delta_rows=recs[0]["rows"],
                   delta_bytes=statistics.median(r["bytes"] for r in recs
                                                 if r["kind"] == "delta"),
                   full_bytes=statistics.median(r["bytes"] for r in recs
                                                if r["kind"] == "full"))
        log(f"[online] delta {out['delta_s'] * 1e3:.0f} ms, full {out['full_s']:.2f} s: "
            f"{out['ratio']:.0f}x")
    else:
        log(f"[online] publish cost failed: {err}")
    return out


def _serving_part(root, quick, args, parts, log) -> dict:

    items = 200_000 if quick else args.online_serve_rows
    out = {}
    d = os.path.join(root, "served")
    # enough staged deltas for every applying window of _load_part (one a second, its
    # 1 s warm-up included), so that none runs out and applies nothing
    plan = _load_plan(quick)
    deltas = plan["applying_windows"] * (int(plan["seconds"]) + 2) if "load" in parts else 0
    log(f"[online] setting up a served model: {items:,} item rows, {deltas} deltas")
    recs, err = common.run_child("bench.online_bench:setup_child",
                                 {"items": items, "dim": 16, "deltas": deltas, "dir": d},
                                 timeout=3600)
    if err or not recs:
        return {"serving": {"error": err}}
    setup = recs[0]
    out["dense_write"] = {k: setup[k] for k in ("dense_params", "dense_bytes",
                                                "graph_write_s", "weights_write_s")}
    serving = {"setup": setup, "items": items, "dim": 16}
    if "inproc" in parts:
        log("[online] in process: the server's request path vs kv.export's SavedModel")
        load = Load().start()
        recs, err = common.run_child("bench.online_bench:inproc_child",
                                     {"dir": d, "setup": setup, "batches": [256, 1],
                                      "seconds": 10.0 if quick else 40.0}, timeout=1800)
        serving["inproc"] = {"records": recs, "error": err, "others_cores": load.stop()}
    if "load" in parts:
        serving["load"] = _load_part(root, d, setup, quick, log)
    out["serving"] = serving
    if "memory" in parts:
        out["memory"] = _memory_part(root, d, setup, items, quick, log)
    return out


def _load_plan(quick) -> dict:
    """How many windows _load_part runs (the setup stages a delta for each second of
    every applying window)."""
    secs = 3.0 if quick else 6.0
    p99_pairs, paced_pairs = (2, 1) if quick else (6, 3)
    return {"seconds": secs, "p99_pairs": p99_pairs, "paced_pairs": paced_pairs,
            "applying_windows": 2 * (p99_pairs + paced_pairs)}     # 2 batch sizes


def _load_part(root, d, setup, quick, log) -> dict:
    """kvcoll serve under load: 8 requests in flight per API and batch, alternated;
    then, with 2 requests in flight (2 workers: the latency is the service's, not the
    queue of a saturated 2-core machine), quiet windows alternated with windows in
    which a delta is applied every second; then the same as an open loop ("paced"),
    requests sent at a fixed rate (half the quiet windows' rate with 2 in flight)
    whatever the answers, each latency counted from the time it was due: a closed loop
    sends less while the server is slow and hides the stall from its p99, an open loop
    does not (and on this shared machine a hiccup of the others' load piles requests
    up too, which it measures as well)."""
    import online

    work = os.path.join(root, "serve-work")
    os.makedirs(work)
    cluster = online.Cluster(work, [])
    plan = _load_plan(quick)
    secs = plan["seconds"]
    common_spec = {"setup": setup, "concurrency": 8, "stage": os.path.join(d, "stage"),
                   "publish": os.path.join(d, "publish")}
    with cluster:
        cluster.start_server(publish_dir=os.path.join(d, "publish"), poll_ms=100)
        common_spec.update(grpc=cluster.grpc, rest=cluster.rest)
        load = Load().start()
        windows = [{"api": api, "batch": b, "seconds": secs, "deltas": False}
                   for _ in range(1 if quick else 3) for b in (1, 256)
                   for api in ("grpc", "rest")]
        log(f"[online] load: {len(windows)} windows of {secs:g} s, 8 requests in flight")
        recs, err = common.run_child("bench.online_bench:load_child",
                                     dict(common_spec, windows=windows), timeout=3600)
        summary = _load_summary(recs)
        log("[online] load: " + ", ".join(f"{k} {v['rps']:,.0f}/s p99 {v['p99_ms']:.1f} ms"
                                           for k, v in summary.items()))
        windows = [{"api": "grpc", "batch": b, "seconds": secs, "deltas": dl,
                    "phase": "p99", "concurrency": 2}
                   for b in (256, 1) for _ in range(plan["p99_pairs"]) for dl in (False, True)]
        log(f"[online] p99 while deltas apply: {len(windows)} windows of {secs:g} s, 2 "
            "requests in flight")
        more, err2 = common.run_child("bench.online_bench:load_child",
                                      dict(common_spec, windows=windows), timeout=3600)
        recs += more
        rates = {}
        for b in (256, 1):
            quiet = [r["rps"] for r in more if r["batch"] == b and not r["deltas"]]
            if quiet:
                rates[b] = max(1.0, round(statistics.median(quiet) / 2))
        windows = [{"api": "grpc", "batch": b, "seconds": secs, "deltas": dl,
                    "phase": "paced", "rate": rate}
                   for b, rate in rates.items() for _ in range(plan["paced_pairs"])
                   for dl in (False, True)]
        log(f"[online] p99 while deltas apply, open loop: {len(windows)} windows of "
            f"{secs:g} s at " + ", ".join(f"{r:g}/s (batch {b})" for b, r in rates.items()))
        err3 = None
        if windows:
            more, err3 = common.run_child("bench.online_bench:load_child",
                                          dict(common_spec, windows=windows), timeout=3600)
            recs += more
        st = online.Client(cluster.grpc, cluster.rest)
        status = st.status()
        st.close()
        out = {"records": recs, "error": err or err2 or err3, "others_cores": load.stop(),
               "status": status}
    out["summary"] = _load_summary(out["records"])
    return out


def _load_summary(recs) -> dict:
    out = {}
    for api in ("grpc", "rest"):
        for b in (1, 256):
            ws = [r for r in recs if r["api"] == api and r["batch"] == b and "phase" not in r]
            if not ws:
                continue
            lat = np.concatenate([r["latencies_ms"] for r in ws]) if ws else np.zeros(0)
            out[f"{api}-{b}"] = {
                "rps": statistics.median(r["rps"] for r in ws),
                "samples_per_s": statistics.median(r["samples_per_s"] for r in ws),
                "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                "errors": sum(r["errors"] for r in ws), "windows": len(ws)}
    for phase, prefix in (("p99", "deltas"), ("paced", "paced")):
        for b in (1, 256):
            ws = [r for r in recs if r.get("phase") == phase and r["batch"] == b]
            if ws:
                out[f"{prefix}-{b}"] = _applying_summary(ws)
    return out


def _applying_summary(ws) -> dict:
    """Quiet windows against the applying windows alternated with them: the p99 of
    each side's latencies pooled, and window by window."""
    quiet_ws = [r for r in ws if not r["deltas"]]
    busy_ws = [r for r in ws if r["deltas"]]
    quiet = np.concatenate([r["latencies_ms"] for r in quiet_ws])
    busy = np.concatenate([r["latencies_ms"] for r in busy_ws])
    q, a = float(np.percentile(quiet, 99)), float(np.percentile(busy, 99))
    return {"rate": ws[0].get("rate"), "quiet_p99_ms": q, "applying_p99_ms": a,
            "ratio": a / q,
            "window_ratios": [w2["p99_ms"] / w1["p99_ms"] for w1, w2 in zip(quiet_ws, busy_ws)],
            "released": sum(len(r["released"]) for r in ws),
            "released_min_per_window": min(len(r["released"]) for r in busy_ws),
            "rps": statistics.median(r["rps"] for r in ws),
            "errors": sum(r["errors"] for r in ws),
            "server_p99_ms": {side: _median_p99s(w) for side, w in
                              (("quiet", quiet_ws), ("applying", busy_ws))}}


def _median_p99s(ws) -> dict:
    """Per server-side histogram, the median over windows of each window's p99 (ms)."""
    names = sorted({n for r in ws for n in (r.get("server_p99_ms") or {})})
    out = {}
    for n in names:
        got = [r["server_p99_ms"][n] for r in ws if (r.get("server_p99_ms") or {}).get(n)]
        out[n] = statistics.median(got) if got else None
    return out


def _memory_part(root, d, setup, items, quick, log) -> dict:
    small = os.path.join(root, "served-small")
    n_small = max(10_000, items // 5)
    log(f"[online] memory: {n_small:,} and {items:,} item rows, served vs SavedModel")
    recs, err = common.run_child("bench.online_bench:setup_child",
                                 {"items": n_small, "dim": 16, "deltas": 0, "dir": small},
                                 timeout=3600)
    if err or not recs:
        return {"error": err}
    out = {"records": []}
    load = Load().start()
    for rep in range(1 if quick else 2):           # alternated: served, SavedModel
        for kind in ("served", "savedmodel"):
            for where, s in ((small, recs[0]), (d, setup)):
                r, e = common.run_child("bench.online_bench:memory_child",
                                        {"kind": kind, "dir": where, "setup": s},
                                        timeout=1800)
                out["records"] += [dict(x, rep=rep) for x in r]
                if e:
                    out.setdefault("errors", []).append(e)
    out["others_cores"] = load.stop()
    for kind in ("served", "savedmodel"):
        per = []
        for rep in range(1 if quick else 2):
            rs = sorted((x for x in out["records"] if x["kind"] == kind and x["rep"] == rep),
                        key=lambda x: x["rows"])
            if len(rs) == 2:
                grow = [x["rss_after"] - x["rss_before"] for x in rs]
                per.append((grow[1] - grow[0]) / (rs[1]["rows"] - rs[0]["rows"]))
        if per:
            out[f"{kind}_bytes_per_row"] = statistics.median(per)
    if "served_bytes_per_row" in out and "savedmodel_bytes_per_row" in out:
        out["ratio"] = out["savedmodel_bytes_per_row"] / out["served_bytes_per_row"]
        log(f"[online] memory per row: served {out['served_bytes_per_row']:.0f} B, "
            f"SavedModel {out['savedmodel_bytes_per_row']:.0f} B")
    shutil.rmtree(small, ignore_errors=True)
    return out


def _freshness_part(root, intervals, probes, quick, log) -> dict:
    order = [None, *intervals] + ([] if quick else [None])
    runs, baseline = {}, []
    for interval in order:
        log(f"[online] freshness run: publish {'every %g s' % interval if interval else 'never'}")
        r = _freshness_run(root, interval, probes, quick, log)
        if interval is None:
            baseline.append(r)
            continue
        got = sorted(p["freshness_s"] for p in r["probes"] if p["freshness_s"] is not None)
        r.update(p50=float(np.percentile(got, 50)) if got else None,
                 p95=float(np.percentile(got, 95)) if got else None,
                 max=max(got) if got else None, seen=len(got), sent=len(r["probes"]),
                 exact=sum(1 for p in r["probes"] if p.get("exact")))
        for key in ("land_to_published_s", "published_to_served_s"):
            xs = [p[key] for p in r["probes"] if key in p]
            r[key + "_p50"] = float(np.median(xs)) if xs else None
        runs[str(interval)] = r
    base = statistics.mean(b["throughput"] for b in baseline) if baseline else None
    for r in runs.values():
        r["throughput_vs_no_publish"] = r["throughput"] / base if base else None
    return {"runs": runs, "baseline": baseline, "baseline_throughput": base}


# -- report --------------------------------------------------------------------------------

def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = ["# Online learning: freshness, publish cost, serving, memory", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
             f"{m.get('memory_gib', '?')} GiB; TensorFlow {m.get('tensorflow')}; "
             f"{m.get('date')}. Other processes used {res['idle_others_cores']:.1f} cores "
             "when the run began (the machine is shared: ratios are measured in the same "
             "run, alternated)." + (" **--quick: small sizes.**" if res.get("quick") else ""),
             ""]
    fr = res.get("freshness")
    if fr:
        lines += ["## Freshness", "",
                  "From a file carrying a new item id landing in the stream (its ctime) to "
                  "the first served prediction that uses that id's trained row; 2 training "
                  "ranks (model.fit on kv.data.stream, settle 1 s) and one kvcoll serve "
                  "(--poll-ms 200) on this machine, files arriving at half the training "
                  "throughput measured with a backlog in the same run; a probe is detected "
                  "when the served prediction for it differs from an unknown id's in the "
                  "same request, and checked against the first published version holding "
                  "its row (\"exact\").", "",
                  "| publish every | probes seen | p50 (s) | p95 (s) | max (s) | exact | "
                  "land -> published p50 (s) | published -> served p50 (s) | arrival / "
                  "throughput | backlog max (samples; s) | others' cores | target p95 <= 15 s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, r in fr["runs"].items():
            ok = "" if float(key) != res["publish_interval_s"] else \
                ("met" if r["p95"] is not None and r["p95"] <= TARGET_P95_S else "NOT met")
            lines.append(
                f"| {float(key):g} s | {r['seen']}/{r['sent']} | {_f(r['p50'])} | "
                f"{_f(r['p95'])} | {_f(r['max'])} | {r['exact']}/{r['seen']} | "
                f"{_f(r['land_to_published_s_p50'])} | {_f(r['published_to_served_s_p50'])} | "
                f"{r.get('arrival_share', 0):.0%} | {r.get('backlog_max', 0):,.0f}; "
                f"{_f(r.get('backlog_max_s'))} | {r['others_cores']:.1f} | {ok} |")
        lines += ["", "Training throughput with a backlog (the same jobs, before the "
                  "probes), against a job that publishes only at its start (run first and "
                  "last):", "",
                  "| publish every | samples/s | vs no publishing (their mean) | a version "
                  "takes (ms, rank 0) | versions every (s) | share of the time publishing |",
                  "|---|---|---|---|---|---|"]
        for b in fr["baseline"]:
            lines.append(f"| never | {b['throughput']:,.0f} | - | - | - | - |")
        for key, r in fr["runs"].items():
            lines.append(f"| {float(key):g} s | {r['throughput']:,.0f} | "
                         f"{_f(r['throughput_vs_no_publish'], '{:.0%}')} | "
                         f"{_f(r.get('publish_ms_mean'), '{:.0f}')} | "
                         f"{_f(r.get('publish_gap_s_mean'))} | "
                         f"{_f(r.get('publish_share'), '{:.1%}')} |")
        if len(fr["baseline"]) == 2:
            a, b = (x["throughput"] for x in fr["baseline"])
            lines += ["", f"The two jobs that do not publish differ by "
                      f"{abs(a - b) / max(a, b):.0%} between them: the machine's noise is "
                      "larger than what publishing costs, which the last column measures "
                      "directly (the time rank 0 spends in a publish, over the time between "
                      "publishes; every rank waits for it, a collective)."]
        lines.append("")
    pb = res.get("publish")
    if pb and "ratio" in pb:
        dw = res.get("dense_write", {})
        lines += ["## Publish cost", "",
                  f"One table of {pb['table_rows']:,} rows (dim 16): 1% of the rows "
                  f"changed ({pb['delta_rows']:,}), then a delta, against a full publish "
                  "of every row (a base), alternated (medians).", "",
                  "| delta | full | full / delta | pairs | delta bytes | full bytes | "
                  f"target >= {TARGET_PUBLISH_RATIO:.0f}x |", "|---|---|---|---|---|---|---|",
                  f"| {pb['delta_s'] * 1e3:.0f} ms | {pb['full_s']:.2f} s | "
                  f"{pb['ratio']:.0f}x | {', '.join(f'{x:.0f}x' for x in pb['pair_ratios'])} | "
                  f"{pb['delta_bytes'] / 2**20:.1f} MiB | {pb['full_bytes'] / 2**20:.0f} MiB | "
                  f"{'met' if pb['ratio'] >= TARGET_PUBLISH_RATIO else 'NOT met'} |", ""]
        if dw:
            lines += [f"The dense model's write, apart (examples/online.py's model, "
                      f"{dw['dense_params']:,} parameters): the serving graph (once per "
                      f"Publisher) {dw['graph_write_s'] * 1e3:.0f} ms, the weights (each "
                      f"version whose dense weights changed) {dw['weights_write_s'] * 1e3:.1f} ms "
                      f"({dw['dense_bytes'] / 1024:.0f} KiB).", ""]
    sv = res.get("serving")
    if sv and "load" in sv:
        s = sv["load"]["summary"]
        lines += ["## Serving", "",
                  f"examples/online.py's model, {sv['items']:,} item rows of dim 16; one "
                  "kvcoll serve (2 workers), a load process with 8 requests in flight, the "
                  "configurations alternated; 1 in 16 item ids unknown. Others' cores "
                  f"during the load: {sv['load']['others_cores']:.1f}.", "",
                  "| API | batch | requests/s | samples/s | p50 (ms) | p99 (ms) | errors |",
                  "|---|---|---|---|---|---|---|"]
        for key in ("grpc-1", "rest-1", "grpc-256", "rest-256"):
            if key in s:
                r = s[key]
                api, b = key.split("-")
                lines.append(f"| {'gRPC' if api == 'grpc' else 'REST'} | {b} | "
                             f"{r['rps']:,.0f} | {r['samples_per_s']:,.0f} | "
                             f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
        ip = sv.get("inproc", {}).get("records") or []
        if ip:
            lines += ["", "In process, the same inputs, alternated: the server's request "
                      "path (ServedModel: checks, one C lookup per table, the serving "
                      "graph) against kv.export's SavedModel loaded with "
                      "tf.saved_model.load:", "",
                      "| batch | server path samples/s | SavedModel samples/s | ratio | "
                      "turns: median ratio (quartiles) | ratio in CPU time | max abs diff | "
                      "target >= 1x at 256 |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in ip:
                ratio = r["server_samples_per_s"] / r["savedmodel_samples_per_s"]
                ok = ("met" if ratio >= TARGET_INPROC else "NOT met") if r["batch"] == 256 \
                    else ""
                q = r["turn_ratio_quartiles"]
                cpu = r["server_cpu_samples_per_s"] / r["savedmodel_cpu_samples_per_s"]
                lines.append(f"| {r['batch']} | {r['server_samples_per_s']:,.0f} | "
                             f"{r['savedmodel_samples_per_s']:,.0f} | {ratio:.2f}x | "
                             f"{r['turn_ratio_median']:.2f}x ({q[0]:.2f}-{q[1]:.2f}) | "
                             f"{cpu:.2f}x | "
                             f"{r['max_abs_diff']:.1e} | {ok} |")
        dl = [(k, v) for k, v in s.items() if k.startswith(("deltas-", "paced-"))]
        if dl:
            st = sv["load"]["status"]
            lines += ["", "p99 while deltas apply (gRPC; a delta of 2% of the item rows "
                      "released every second during the applying windows), alternated "
                      "with quiet windows: with 2 requests in flight (a closed loop), then "
                      "as an open loop at half the rate the quiet windows sustained with 2 "
                      "in flight (each request sent when due whatever the answers, its "
                      "latency counted from then: a stall delays every request behind it, "
                      "which a closed loop hides):", "",
                      "| load | batch | requests/s | quiet p99 (ms) | applying p99 (ms) | "
                      "ratio | windows | deltas applied (fewest in a window) | errors | "
                      "target <= 1.2x |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for k, v in dl:
                mode = "2 in flight" if k.startswith("deltas-") else \
                    f"open loop, {_f(v.get('rate'), '{:,.0f}')}/s"
                lines.append(f"| {mode} | {k.split('-')[1]} | {_f(v.get('rps'), '{:,.0f}')} | "
                             f"{v['quiet_p99_ms']:.2f} | "
                             f"{v['applying_p99_ms']:.2f} | {v['ratio']:.2f}x | "
                             f"{', '.join(f'{x:.2f}' for x in v['window_ratios'])} | "
                             f"{v['released']} ({_f(v.get('released_min_per_window'), '{}')}) | "
                             f"{v['errors']} | "
                             f"{'met' if v['ratio'] <= TARGET_DELTA_P99 else 'NOT met'} |")
            sides = [(k, v["server_p99_ms"]) for k, v in dl if v.get("server_p99_ms")]
            if sides:
                lines += ["", "Where the p99 goes on the server (its histograms read before and "
                          "after each window, `kvcoll_serve_request_seconds` for gRPC and "
                          "`kvcoll_serve_stage_seconds`; each window's p99 interpolated in "
                          "its bucket, median over windows; quiet / applying, ms): the "
                          "request from its arrival to its response, its wait for a batch "
                          "(queue), per merged batch the hand-off to a worker (dispatch) and "
                          "the work on it (predict: the ids' rows, lookup, and the serving "
                          "graph, graph). What the client measured "
                          "beyond the request is the network, gRPC's client and its own "
                          "process.", "",
                          "| load | batch | request | queue | dispatch | predict | lookup | "
                          "graph |",
                          "|---|---|---|---|---|---|---|---|"]
                for k, sp in sides:
                    mode = "2 in flight" if k.startswith("deltas-") else "open loop"

                    def pair(n, sp=sp):
                        q, a = sp["quiet"].get(n), sp["applying"].get(n)
                        return f"{_f(q, '{:.2f}')} / {_f(a, '{:.2f}')}"
                    lines.append(f"| {mode} | {k.split('-')[1]} | " + " | ".join(
                        pair(n) for n in ("request", "queue", "dispatch", "predict", "lookup",
                                          "graph")) + " |")
            lines += ["", f"The server applied {st['applied']} deltas; the longest C call of "
                      f"an apply took {st['apply_lock_ms_max']:.2f} ms of CPU "
                      f"({st['apply_call_ms_max']:.2f} ms of wall time)."]
            if "gc_pauses" in st:
                lines[-1] += (f" Python's full collections in the server: {st['gc_pauses']}, "
                              f"the longest {st['gc_pause_ms_max']:.1f} ms "
                              f"({st['gc_frozen_objects']:,} objects loaded at start kept "
                              "out of their reach).")
            recs = [r for r in sv["load"]["records"] if "client_gc_pauses" in r]
            if recs:
                lines[-1] += (" The load process's own (it freezes its heap too, or a "
                              "full collection of its own delays the sends due meanwhile): "
                              f"{sum(r['client_gc_pauses'] for r in recs)}, the longest "
                              f"{max(r['client_gc_ms_max'] for r in recs):.1f} ms.")
        lines.append("")
    mem = res.get("memory")
    if mem and "ratio" in mem:
        lines += ["## Memory", "",
                  "RSS per row (dim 16), from the growth between two table sizes: a "
                  "server's ServedModel against kv.export's SavedModel loaded with "
                  "tf.saved_model.load (after one prediction each).", "",
                  "| served bytes/row | SavedModel bytes/row | SavedModel / served |",
                  "|---|---|---|",
                  f"| {mem['served_bytes_per_row']:.0f} | {mem['savedmodel_bytes_per_row']:.0f} "
                  f"| {mem['ratio']:.2f}x |", ""]
    return "\n".join(lines) + "\n"


def _plot(res: dict, path: str) -> None:
    fr = res.get("freshness")
    if not fr or not fr["runs"]:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    keys = list(fr["runs"])
    for i, key in enumerate(keys):
        xs = [p["freshness_s"] for p in fr["runs"][key]["probes"]
              if p["freshness_s"] is not None]
        a.scatter([i + 0.08 * (j % 5 - 2) for j in range(len(xs))], xs, s=14)
        r = fr["runs"][key]
        if r["p95"] is not None:
            a.hlines([r["p50"], r["p95"]], i - 0.3, i + 0.3, colors=["k", "r"], lw=1)
    a.axhline(TARGET_P95_S, color="grey", ls="--", lw=1, label="target: p95 <= 15 s at 5 s")
    a.set_xticks(range(len(keys)), [f"every {float(k):g} s" for k in keys])
    a.set_ylabel("landing -> served (s)")
    a.set_title("Freshness per probe (black p50, red p95)")
    a.legend(fontsize=8)
    head = fr["runs"].get(str(res["publish_interval_s"]))
    if head and head.get("backlog_trace"):
        t0 = head["backlog_trace"][0][0]
        b.plot([t - t0 for t, _ in head["backlog_trace"]],
               [x for _, x in head["backlog_trace"]], lw=1)
        b.set_xlabel("seconds")
        b.set_ylabel("samples landed, not yet trained")
        b.set_title(f"Backlog, publishing every {res['publish_interval_s']:g} s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
