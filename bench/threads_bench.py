"""C threads per rank: a step's table work on 1 and on 2 threads, TensorFlow at 1 thread.

    python -m bench threads            # 5 pairs (about 10 minutes)
    python -m bench threads --quick    # 1 short pair

The exchange kernels (csrc/kv_exchange.c) split a step's table work (dedup and routing,
lookups and inserts, gradient sums, the row optimizer, the commit, the gather gradient)
over a pool of C threads, by table and by key range (KVCOLL_THREADS; the default on a
machine whose cores TensorFlow takes, like this one, is 1). This measures what 2 threads
do against 1, on the same data (kvcoll.data.SyntheticCTR, DeepFM's 26 tables of dim 8,
Adagrad rows, global batch 4096), with TensorFlow's intra-op pool at 1 thread:

- phases: one process, no MPI, no TensorFlow: each kernel's ms per step (plan, serve,
  prepare, commit, gather gradient) through kvcoll.exchange.kernels.TableSet;
- exchange: bench/train_worker.py --impl exchange on 1 rank: a step's pull and push
  through the Trainer's exchange, no TensorFlow step;
- train: bench/train_worker.py --impl kvcoll on 1 rank: the whole training step.

Runs alternate 1 and 2 threads in pairs (the order flips every pair) and each result is
reported as the ratio of the two runs of its pair (2 threads / 1 thread), so a load that
drifts over the run touches both alike; the median and the range over the pairs are
reported, with the CPU the rest of the machine used just before each run. There is no
target: on 2 cores, the second thread only helps while TensorFlow's one thread does not
compute (the steps are not pipelined yet), and it competes with everything else the
machine runs.

Writes bench/results/threads.json and threads.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import common

WORKER = os.path.join(common.ROOT, "bench", "train_worker.py")
PHASES = ("plan", "serve", "prepare", "commit", "gather_grad")
FIELDS, DIM = 26, 8


# -- the phases child (no MPI, no TensorFlow) ------------------------------------------------

def phases_child(spec: dict) -> None:
    """Child: `steps` steps of DeepFM's tables through the exchange kernels with
    spec["threads"] C threads; ms per step of each kernel."""
    import kvcoll as kv
    from kvcoll.data import SyntheticCTR
    from kvcoll.exchange.kernels import TableSet, gather_grad, set_threads
    from kvcoll.routing import OwnerMap

    set_threads(spec["threads"])
    tables = [kv.KvTable(DIM, name=f"C{i + 1}", seed=0, initializer=("normal", 0.0, 0.01),
                         optimizer=kv.optimizers.Adagrad(0.2, initial_accumulator_value=0.01))
              for i in range(FIELDS)]
    tset = TableSet(tables)
    data = SyntheticCTR(seed=0, vocab=10**7)
    spent = dict.fromkeys(PHASES, 0.0)
    cpu = dict.fromkeys(PHASES, 0.0)
    owners = OwnerMap.even(1)

    def now():
        return time.perf_counter(), time.process_time()  # wall, CPU of every thread

    for step in range(spec["warmup"] + spec["steps"]):
        b = data.batch(step, spec["batch"], 0, 1)
        ids = [np.ascontiguousarray(b["categorical"][:, i]) for i in range(FIELDS)]
        t = [now()]
        send, counts, _, _, pos, _ = tset.plan(ids, owners)
        t.append(now())
        reply = np.empty(int((counts * tset.dims).sum()), np.float32)
        state = tset.serve(send, counts, step + 1, True, reply)
        t.append(now())
        grads = np.full(reply.size, 1e-4, np.float32)
        prepared = tset.prepare(state, grads, step + 1)
        t.append(now())
        tset.commit(prepared)
        t.append(now())
        # the model's gather gradient: one row per gathered position (every id of the
        # batch), summed per row of the pulled matrix
        gather_grad(np.full((pos.size, DIM), 1e-4, np.float32), pos, reply.size // DIM)
        t.append(now())
        if step >= spec["warmup"]:
            for k, name in enumerate(PHASES):
                spent[name] += t[k + 1][0] - t[k][0]
                cpu[name] += t[k + 1][1] - t[k][1]
    ms = {k: v / spec["steps"] * 1e3 for k, v in spent.items()}
    ms["total"] = sum(ms.values())
    cpu_ms = {k: v / spec["steps"] * 1e3 for k, v in cpu.items()}
    cpu_ms["total"] = sum(cpu_ms.values())
    common.emit({"what": "phases", "threads": spec["threads"], "ms_per_step": ms,
                 "cpu_ms_per_step": cpu_ms})
    for tb in tables:
        tb.close()


# -- runs ----------------------------------------------------------------------------------------

def _mpirun(world: int, threads: int, args: list[str], timeout: float) -> dict:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-x", "KVCOLL_THREADS",
               "-np", str(world), sys.executable, WORKER, *args, "--threads", "1",
               "--out", out]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   TF_CPP_MIN_LOG_LEVEL="2", KVCOLL_THREADS=str(threads))
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def measure(pairs: int, steps: int, batch: int, threads: tuple, quiet_wait: float) -> list:
    records = []
    for pair in range(pairs):
        order = threads if pair % 2 == 0 else tuple(reversed(threads))
        for n in order:
            runs = [
                ("phases", lambda n=n: _phases(n, steps, batch)),
                ("exchange", lambda n=n: _mpirun(1, n, [
                    "--impl", "exchange", "--steps", str(steps), "--batch-size", str(batch)],
                    1800)),
                ("train", lambda n=n: _mpirun(1, n, [
                    "--impl", "kvcoll", "--steps", str(steps), "--batch-size", str(batch),
                    "--eval-samples", "4096"], 3600)),
            ]
            for what, fn in runs:
                busy = common.wait_until_quiet(quiet_wait)
                print(f"[threads] pair {pair + 1}/{pairs}: {what}, {n} C thread(s) "
                      f"(others busy: {busy:.2f} cores)", flush=True)
                r = fn()
                r.update(what=what, pair=pair, threads=n, others_busy_cores=round(busy, 2))
                if what != "phases" and r.get("c_threads") != n:
                    raise RuntimeError(f"{what}: asked for {n} C threads, the run had "
                                       f"{r.get('c_threads')}")
                records.append(r)
    return records


def _phases(threads: int, steps: int, batch: int) -> dict:
    got, error = common.run_child("bench.threads_bench:phases_child",
                                  {"threads": threads, "steps": steps, "batch": batch,
                                   "warmup": 5}, timeout=1800)
    if error or not got:
        raise RuntimeError(f"phases with {threads} thread(s): {error}")
    return got[0]


# -- the report ---------------------------------------------------------------------------------

def _value(r: dict, key: str) -> float:
    """ms per step of `key` (cpu:<phase>: the CPU time of every thread, not wall)."""
    field, _, key = key.rpartition(":")
    ms = r["cpu_ms_per_step" if field == "cpu" else "ms_per_step"]
    return float(ms[key]) if key in ms else float("nan")


def _ratios(records: list, what: str, key: str, threads: tuple) -> list[float]:
    """Per pair: (ms with threads[1]) / (ms with threads[0])."""
    out = []
    for pair in sorted({r["pair"] for r in records}):
        by = {r["threads"]: r for r in records if r["what"] == what and r["pair"] == pair}
        if all(t in by for t in threads):
            out.append(_value(by[threads[1]], key) / _value(by[threads[0]], key))
    return out


def markdown(records: list, steps: int, batch: int, threads: tuple, machine: dict) -> str:
    a, b = threads
    pairs = len({r["pair"] for r in records})
    lines = [
        "# C threads per rank (DeepFM's 26 tables, synthetic CTR data)", "",
        f"`./dev bench threads` — {pairs} pair(s) of runs, {a} vs {b} C thread(s) "
        f"(KVCOLL_THREADS), TensorFlow at 1 intra-op thread; {steps} timed steps of a "
        f"global batch {batch}, 1 rank; {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['date']}.", "",
        f"Ratios are ms per step with {b} threads / with {a}, within each pair (below 1: "
        "faster); median [min, max] over the pairs. No target.", "",
        f"| measurement | ms/step, {a} thread(s) (median) | ms/step, {b} (median) | "
        f"ratio {b}/{a}: median [min, max] |",
        "|---|---|---|---|"]
    rows = [("phases", k, f"kernel alone: {k}") for k in (*PHASES, "total")]
    rows += [("phases", f"cpu:{k}", f"kernel alone: {k}, CPU of all threads")
             for k in ("serve", "prepare", "total")]
    rows += [("exchange", "total", "exchange alone (pull + push), 1 rank"),
             ("exchange", "tables", "exchange alone: in the tables' C calls"),
             ("train", "total", "training step, 1 rank"),
             ("train", "exchange", "training step: exchange"),
             ("train", "compute", "training step: TensorFlow compute")]
    for what, key, label in rows:
        ms = {t: [_value(r, key) for r in records if r["what"] == what and r["threads"] == t]
              for t in threads}
        ratios = _ratios(records, what, key, threads)
        if not ratios:
            continue
        lines.append(f"| {label} | {statistics.median(ms[a]):.2f} | "
                     f"{statistics.median(ms[b]):.2f} | {statistics.median(ratios):.2f} "
                     f"[{min(ratios):.2f}, {max(ratios):.2f}] |")
    busy = [r["others_busy_cores"] for r in records]
    lines += ["", f"- the rest of the machine used {min(busy):.2f} to {max(busy):.2f} "
              f"cores (median {statistics.median(busy):.2f}) just before the runs, out of "
              f"{machine['cores']}: the second C thread competes with that load.",
              "- phases: one process, no MPI, no TensorFlow "
              "(bench/threads_bench.py:phases_child); exchange and train: "
              "bench/train_worker.py --impl exchange / kvcoll under mpirun -np 1.", ""]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------

def add_arguments(p) -> None:
    g = p.add_argument_group("threads")
    g.add_argument("--threads-pairs", type=int, default=5, help="pairs of runs (1 vs 2)")
    g.add_argument("--threads-steps", type=int, default=150, help="timed steps per run")
    g.add_argument("--threads-batch", type=int, default=4096, help="global batch")
    g.add_argument("--threads-quiet-wait", type=float, default=20.0,
                   help="seconds to wait at most, before each run, for the machine to go "
                        "quiet (default 20; --quick 0)")


def run(args) -> None:
    quick = args.quick
    pairs = 1 if quick else args.threads_pairs
    steps = 20 if quick else args.threads_steps
    batch = 1024 if quick else args.threads_batch
    wait = 0.0 if quick else args.threads_quiet_wait
    threads = (1, 2)
    out_dir = args.out or (tempfile.mkdtemp(prefix="kvbench-quick-") if quick
                           else common.RESULTS)
    records = measure(pairs, steps, batch, threads, wait)
    common.publish(out_dir, "threads", records,
                   lambda m: markdown(records, steps, batch, threads, m))
