"""The demo's measuring and reporting, kept apart from what a user copies (train.py).

examples/train.py trains with model.fit; this module watches the run through a Keras
callback (`DemoRun`): the loss of every step this rank took, where a step's time goes,
periodic log lines with a quick evaluation, TensorBoard scalars, a straggler switch for
tests and benchmarks; and at the end the evaluation against the planted model, the
tables' statistics and the metrics JSON the tests and benchmarks read.
"""

from __future__ import annotations

import os
import sys
import time

import keras
import numpy as np

import kvcoll as kv
from kvcoll.data import auc
from kvcoll.keras import engine_of


def say(*a):
    """Print on rank 0 only."""
    if kv.rank() == 0:
        print(*a, flush=True)


def summary_scalar(tag: str, value: float) -> None:
    """tf.summary.scalar without the tensorboard package (which tf.summary.scalar needs
    and requirements.txt does not pin): the same event, with the scalars plugin's
    metadata, written by TensorFlow's own summary op into the default writer."""
    import tensorflow as tf
    from tensorflow.core.framework import summary_pb2

    meta = summary_pb2.SummaryMetadata(data_class=summary_pb2.DATA_CLASS_SCALAR)
    meta.plugin_data.plugin_name = "scalars"
    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=meta)


def evaluate(model, data, n: int, features) -> dict:
    """AUC and log loss of the model (and of the planted model, on synthetic data) on
    the first n eval samples, over all ranks (a collective)."""
    cols = []
    for chunk in data.eval_chunks(n):
        logit = model.predict(features(chunk), batch_size=data.args.eval_chunk,
                              verbose=0)[:, 0].astype(np.float64)
        c = [logit, chunk["label"].astype(np.float64)]
        if data.planted is not None:
            c.append(data.planted(chunk) if len(logit) else np.zeros(0))
        cols.append(np.stack(c, axis=1))
    width = 3 if data.planted is not None else 2
    allr = kv.allgather(np.concatenate(cols) if cols else np.zeros((0, width)))
    logit, label = allr[:, 0], allr[:, 1]
    out = {"eval_samples": int(len(label)), "eval_auc": auc(label, logit),
           "eval_logloss": logloss(label, logit), "eval_ctr": float(label.mean())}
    if data.planted is not None:
        out["planted_auc"] = auc(label, allr[:, 2])
        out["planted_logloss"] = logloss(label, allr[:, 2])
    return out


def logloss(label, logit) -> float:
    # -[y log s(x) + (1-y) log(1-s(x))] = softplus(x) - y x
    return float(np.mean(np.logaddexp(0.0, logit) - label * logit))


def lifecycle_stats(engine, evict_pauses) -> dict:
    """Per table over all ranks: rows, bytes, load factor, admitted, rejected, evicted,
    dropped gradients and bytes per row beyond its floats; the longest eviction pause
    on any rank. A collective."""
    fields = ("rows", "bytes", "index_slots", "admitted", "rejected", "evicted",
              "dropped_grads", "pending")
    local = [t.stats() for t in engine.tables.values()]
    total = kv.allreduce(np.array([[getattr(s, f) for f in fields] for s in local],
                                  np.float64), op="sum")
    within = all(t.max_rows is None or s.rows <= t.max_rows
                 for t, s in zip(engine.tables.values(), local))
    pauses = kv.allgather(np.array([[max(evict_pauses, default=0.0), len(evict_pauses),
                                     sum(evict_pauses), within]], np.float64))
    tables = {}
    for (name, t), s, row in zip(engine.tables.items(), local, total):
        d = {f: int(v) for f, v in zip(fields, row)}
        d["load_factor"] = d["rows"] / max(1, d["index_slots"])
        d["bytes_per_row_overhead"] = \
            (d["bytes"] - d["rows"] * 4 * (s.dim + s.slot_floats)) / d["rows"] if d["rows"] else 0.0
        d["max_rows_per_rank"] = t.max_rows
        tables[name] = d
    return {"tables": tables,
            "admitted": sum(d["admitted"] for d in tables.values()),
            "rejected": sum(d["rejected"] for d in tables.values()),
            "evicted": sum(d["evicted"] for d in tables.values()),
            "dropped_grads": sum(d["dropped_grads"] for d in tables.values()),
            "evict_calls": int(pauses[0, 1]),
            "max_evict_pause_ms": float(pauses[:, 0].max()) * 1e3,
            "mean_evict_pause_ms": float(pauses[:, 2].sum() / max(1, pauses[:, 1].sum())) * 1e3,
            "within_budget": bool(pauses[:, 3].all())}


class Progress:
    """Rank 0's progress: a rich bar on a terminal, plus a plain line every --log-every
    steps (readable in CI logs)."""

    def __init__(self, total, bar):
        self.rank0 = kv.rank() == 0
        self.bar = None
        # Under mpirun a rank's stdout is a pty even when mpirun's output goes to a file:
        # CI (CI=...) and ./dev (when not on a terminal) turn the bar off; so does
        # --no-progress.
        if bar and self.rank0 and total and sys.stdout.isatty() and not os.environ.get("CI") \
                and os.environ.get("TERM", "dumb") != "dumb":
            try:
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress as P,
                                           TextColumn, TimeRemainingColumn)
                self.bar = P(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                             transient=True)
                self.task = self.bar.add_task("train", total=total, info="")
                self.bar.start()
            except ImportError:
                self.bar = None

    def update(self, step, loss):
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=f"loss {loss:.4f}")

    def line(self, text):
        if not self.rank0:
            return
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


class LoggedCheckpoint(kv.callbacks.Checkpoint):
    """kv.callbacks.Checkpoint that says what it saved on rank 0."""

    def __init__(self, progress, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.progress = progress
        self.seconds = 0.0

    def on_save(self, info):
        self.seconds += info.seconds
        self.progress.line(f"step {info.step:5d}  saved {info.kind} checkpoint {info.name}: "
                           f"{info.rows:,} rows, {info.bytes / 2**20:,.1f} MiB, "
                           f"{info.seconds:.2f}s")


class DemoRun(keras.callbacks.Callback):
    """Watches a fit: this rank's own steps and their losses, where a step's time goes
    (data, the engine's phases, evictions; not evaluations or saves), a log line every
    `log_every` steps (BSP: with a quick evaluation over all ranks, a collective every
    rank makes at the same global step), TensorBoard scalars, a straggler's sleep and
    every rank's random per-step delay (--jitter-ms).
    Pass the training batches through `timed(batches)` so their reading is timed."""

    def __init__(self, args, data, features, progress, writer, evict=None, slow_s=0.0,
                 total=None, jitter_s=0.0, jitter_seed=0):
        super().__init__()
        self.args, self.data, self.features = args, data, features
        self.progress, self.writer, self.evict, self.slow_s = progress, writer, evict, slow_s
        self.jitter_s = jitter_s    # --jitter-ms: mean of a random sleep every step
        self._jitter = np.random.default_rng(jitter_seed) if jitter_s else None
        self.total = total
        self._fetch = 0.0           # seconds the current batch took to read
        self.data_seconds = 0.0
        self.losses = []            # (step, loss) of every step this rank had data for
        self.served = 0             # BSP: steps this rank joined with no data of its own
        self.train_time = self.first_step = self.eval_time = 0.0
        self.own_time, self.own_samples = 0.0, 0
        self.samples = 0            # samples of this rank's own, every step (first included)
        self.timings0 = None
        self._last_log = None       # (step, train_time)
        self._pauses = 0

    def timed(self, batches):
        """The batches, each one's reading timed."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            b = next(it, None)
            if b is None:
                return
            self._fetch = time.perf_counter() - t0
            yield b

    def on_train_begin(self, logs=None):
        self.eng = engine_of(self.model)
        self.start = self.eng.step
        self._last_log = (self.start + 1, 0.0)

    def on_train_batch_begin(self, batch, logs=None):
        self._t0 = time.perf_counter()
        self._own = self.eng.local_steps
        if self.slow_s:
            time.sleep(self.slow_s)  # --slow-rank: a straggler
        if self._jitter is not None:  # --jitter-ms: a transient delay on every rank
            time.sleep(self._jitter.exponential(self.jitter_s))

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        eng = self.eng
        step = eng.step
        mine = eng.local_steps > self._own
        fetch, self._fetch = (self._fetch if mine else 0.0), 0.0
        spent = now - self._t0 + fetch
        if self.evict is not None:  # evictions count as training time
            spent += sum(self.evict.pauses[self._pauses:])
            self._pauses = len(self.evict.pauses)
        if mine:
            self.losses.append((step, eng.last_loss))
            self.samples += eng.last_samples
        else:
            self.served += 1
        if step == self.start + 1:
            self.first_step = spent
            self.timings0 = dict(eng.timings)
        else:
            self.train_time += spent
            self.data_seconds += fetch
            if mine:
                self.own_time += spent
                self.own_samples += eng.last_samples
        if self.writer is not None and mine:
            with self.writer.as_default(step=step):
                summary_scalar("loss", eng.last_loss)
        self.progress.update(step, eng.last_loss)
        if step % self.args.log_every == 0 and step != self.total:
            self._log(step)

    def _log(self, step):
        eng, args = self.eng, self.args
        recent = np.mean([l for _, l in self.losses[-args.log_every:]]) if self.losses \
            else float("nan")
        if not eng.synchronous:  # ranks step on their own: no collective here
            sps = (step - self._last_log[0]) * eng.last_samples / \
                max(1e-9, self.train_time - self._last_log[1])
            self._last_log = (step, self.train_time)
            self.progress.line(f"step {step:5d}  loss {recent:.4f}  {sps:,.0f} samples/s on "
                               f"rank 0  staleness <= {eng.loop.ex.staleness_observed}")
            return
        te = time.perf_counter()
        quick = evaluate(self.model, self.data, min(args.eval_samples, 16384), self.features)
        rows = int(kv.allreduce(np.array([sum(len(t) for t in eng.tables.values())]),
                                op="sum")[0])
        sps = (step - self._last_log[0]) * args.batch_size / \
            max(1e-9, self.train_time - self._last_log[1])
        self._last_log = (step, self.train_time)
        self.progress.line(f"step {step:5d}  loss {recent:.4f}  auc {quick['eval_auc']:.4f}  "
                           f"{sps:,.0f} samples/s  {rows:,} rows")
        if self.writer is not None:
            with self.writer.as_default(step=step):
                summary_scalar("eval_auc", quick["eval_auc"])
                summary_scalar("samples_per_sec", sps)
                summary_scalar("table_rows", rows)
        self.eval_time += time.perf_counter() - te

    def per_step(self) -> dict:
        """Milliseconds per timed step, by phase (the first, tracing, step not timed)."""
        eng = self.eng
        timed = max(1, eng.step - self.start - 1 if eng.synchronous else len(self.losses) - 1)
        out = {k: (v - (self.timings0 or {}).get(k, 0.0)) / timed * 1e3
               for k, v in eng.timings.items()}
        out["data"] = self.data_seconds / timed * 1e3
        out["total"] = self.train_time / timed * 1e3
        # "tables" is the part of "exchange" spent in the tables' C calls: not added twice
        out["other"] = out["total"] - sum(v for k, v in out.items()
                                          if k not in ("total", "tables"))
        return out


def report(metrics: dict, args, writer) -> None:
    """Rank 0 writes the metrics JSON and TensorBoard's last scalars, and prints the
    summary."""
    if kv.rank() != 0:
        return
    import json
    from pathlib import Path

    if "planted_auc" in metrics:
        metrics["target_auc"] = 0.5 + 0.8 * (metrics["planted_auc"] - 0.5)
    from kvcoll import elastic  # kvcoll: lost ranks an elastic run survived, with timings
    metrics["elastic_events"] = elastic.events()
    if args.metrics_out:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.metrics_out).write_text(json.dumps(metrics, indent=1) + "\n")
    steps, sps = metrics["steps"], metrics["samples_per_sec"]
    if writer is not None:
        with writer.as_default(step=steps):
            summary_scalar("eval_auc", metrics["eval_auc"])
            summary_scalar("samples_per_sec", sps)
            summary_scalar("table_rows", metrics["table_rows"])
        writer.close()
    print(f"\n{steps} steps of {args.batch_size} on {metrics['world_size']} rank(s): "
          f"{sps:,.0f} samples/s ({metrics['train_seconds']:.1f}s, first step "
          f"{metrics['first_step_seconds']:.1f}s)")
    print("per step: " + "  ".join(f"{k} {v:.1f} ms"
                                   for k, v in metrics["timings_ms_per_step"].items()))
    print(f"final loss {metrics['final_loss']:.4f}   eval logloss {metrics['eval_logloss']:.4f}"
          f" on {metrics['eval_samples']:,} held-out samples")
    line = f"eval AUC {metrics['eval_auc']:.4f}"
    if "planted_auc" in metrics:
        target = metrics["target_auc"]
        reached = "reached" if metrics["eval_auc"] >= target else "NOT reached"
        line += (f"   planted AUC {metrics['planted_auc']:.4f} (the best possible)   "
                 f"target >= {target:.4f}: {reached}")
    print(line)
    print(f"tables: {metrics['table_rows']:,} rows, {metrics['table_bytes'] / 2**20:,.0f} MiB "
          f"over all ranks")
    if metrics["evict_calls"] or metrics["admit_min_count"] > 1:
        print(f"lifecycle: {metrics['admitted']:,} admitted, {metrics['rejected']:,} "
              f"lookups rejected, {metrics['evicted']:,} evicted, longest eviction pause "
              f"{metrics['max_evict_pause_ms']:.1f} ms, every table within its budget: "
              f"{metrics['within_budget']}")
    if args.metrics_out:
        print(f"metrics: {args.metrics_out}")
