"""Train DeepFM or Wide & Deep on sharded kvcoll tables over N MPI ranks.

26 categorical fields (one growable table each, sharded over the ranks) and 13 numeric
ones, on a built-in synthetic CTR data set: Zipf ids over 10^7 per field and labels
drawn from a planted model, so the best achievable AUC (planted_auc) is known. The
global batch of step t depends only on --seed and t, never on the world size: each rank
generates just its own slice. --data PATH reads Criteo TSV files instead; unless
--eval-data is given, the first --eval-samples lines (rounded up to whole batches) are
held out for evaluation and not trained on.

    mpirun -np 2 python examples/train.py                      # DeepFM, synthetic data
    mpirun -np 2 python examples/train.py --model wdl --steps 200 --metrics-out m.json
    mpirun -np 4 python examples/train.py --data day_0.gz --eval-data day_23.gz

Lines tagged `# kvcoll:` are what a single-process Keras script adds to run here.

Checkpoints: --checkpoint-dir DIR with --checkpoint-every N (full saves) and
--incremental-every N (deltas of the rows changed since the previous save) saves during
training and once more at the end; --restore continues from DIR's latest checkpoint, on
any number of ranks (--steps is the total, counted from step 0). --export-dir DIR writes
a SavedModel that serves with TensorFlow alone, plus the embedding dictionary.

    mpirun -np 2 python examples/train.py --steps 200 --checkpoint-dir ck --checkpoint-every 100
    mpirun -np 3 python examples/train.py --steps 400 --checkpoint-dir ck --restore --export-dir ex

At the end rank 0 prints the evaluation AUC (on eval samples never trained on), the
planted AUC, the throughput and where a step's time goes. --metrics-out writes all of
it as JSON; --logdir writes TensorBoard scalars.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcoll as kv  # kvcoll:
from kvcoll import runtime  # kvcoll:
from kvcoll.data import SyntheticCTR, auc, even_split, read_criteo  # kvcoll: per-rank slices

NUM_FIELDS, NUM_NUMERIC = 26, 13

# Defaults: 2 ranks on an idle 2-core machine train the default run in about 20 s
# (about a minute when the cores are shared) and reach eval_auc >= 0.5 + 0.8 *
# (planted_auc - 0.5) with a margin: 0.773 for a planted 0.806 (seed 0; 0.773 vs 0.806
# for seed 1), the target being first met near step 150. tests/launch/test_train.py
# holds the README's run to it.
DEFAULTS = dict(steps=400, batch_size=4096, dim=8, lr=2e-3, sparse_lr=0.2,
                sparse_init_accum=0.01, init_std=0.01)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("deepfm", "wdl"), default="deepfm")
    # Read by kv.init() from sys.argv; declared here for --help and validation.
    p.add_argument("--step-mode", choices=("bsp", "ssp", "asp"), default=None,
                   help="how far a rank may run ahead (default: KVCOLL_STEP_MODE or bsp)")
    p.add_argument("--staleness", type=int, default=None,
                   help="SSP's bound in steps (default: KVCOLL_STALENESS or 4)")
    p.add_argument("--slow-rank", type=int, default=None, metavar="R",
                   help="debug: rank R sleeps --slow-ms per step (a straggler, for tests and "
                        "benchmarks)")
    p.add_argument("--slow-ms", type=float, default=0.0, metavar="M",
                   help="milliseconds --slow-rank sleeps per step")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps (default {DEFAULTS['steps']} on synthetic data; "
                        "with --data, until the data ends)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="global batch, split over the ranks as evenly as possible")
    p.add_argument("--dim", type=int, default=DEFAULTS["dim"],
                   help="FM vector width (rows are dim + 1 wide: one first-order weight)")
    p.add_argument("--hidden", default="256,128", help="deep MLP units, comma-separated")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="Adam, dense weights")
    p.add_argument("--sparse-lr", type=float, default=DEFAULTS["sparse_lr"],
                   help="Adagrad, embedding rows (in C, on their owners)")
    p.add_argument("--sparse-init-accum", type=float, default=DEFAULTS["sparse_init_accum"],
                   help="Adagrad's initial accumulator for new rows")
    p.add_argument("--init-std", type=float, default=DEFAULTS["init_std"],
                   help="new rows start as N(0, init_std^2)")
    p.add_argument("--seed", type=int, default=0, help="data, planted model and weights")
    p.add_argument("--vocab", type=int, default=10**7, help="synthetic ids per field")
    p.add_argument("--data", nargs="+", metavar="PATH", help="Criteo TSV file(s) (.gz ok)")
    p.add_argument("--eval-data", nargs="+", metavar="PATH",
                   help="Criteo TSV file(s) to evaluate on (default: hold out the start of --data)")
    p.add_argument("--eval-samples", type=int, default=100_000)
    p.add_argument("--eval-chunk", type=int, default=16384, help="predict batch per rank")
    p.add_argument("--log-every", type=int, default=100,
                   help="steps between log lines (with a quick AUC on a few eval samples)")
    p.add_argument("--metrics-out", metavar="PATH", help="write the run's metrics as JSON")
    p.add_argument("--logdir", metavar="DIR", help="write TensorBoard scalars here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (the plain --log-every lines remain)")
    f = p.add_argument_group("feature lifecycle (per table)")
    f.add_argument("--admit-min-count", type=int, default=0, metavar="K",
                   help="an id gets a row only once seen in K steps (0/1: at once); before, "
                        "it reads zeros and its gradients are dropped")
    f.add_argument("--admit", choices=("exact", "bloom"), default="exact",
                   help="count unadmitted ids exactly, or in a bounded counting Bloom filter")
    f.add_argument("--evict-after-steps", type=int, default=None, metavar="T",
                   help="evict rows not touched in the last T steps")
    f.add_argument("--max-rows-per-table", type=int, default=None, metavar="R",
                   help="row budget of each whole table (summed over ranks; each rank keeps "
                        "ceil(R / world)); least recently used rows go first")
    f.add_argument("--evict-every", type=int, default=50, metavar="N",
                   help="evict each table every N steps, the tables staggered over the steps "
                        "(and all of them before saves and at the end)")
    g = p.add_argument_group("checkpoints and export")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (and at the end)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="a full checkpoint every N steps (0: only at the end)")
    g.add_argument("--incremental-every", type=int, default=0, metavar="N",
                   help="an incremental checkpoint every N steps, between full ones")
    g.add_argument("--restore", action="store_true",
                   help="continue from --checkpoint-dir's latest checkpoint (any world size)")
    g.add_argument("--export-dir", metavar="DIR",
                   help="at the end, write a SavedModel for serving and the embedding dictionary")
    args = p.parse_args(argv)
    if args.admit_min_count < 0 or args.evict_every < 1 \
            or (args.evict_after_steps is not None and args.evict_after_steps < 1) \
            or (args.max_rows_per_table is not None and args.max_rows_per_table < 0):
        p.error("--admit-min-count and --max-rows-per-table must be >= 0, --evict-every and "
                "--evict-after-steps >= 1")
    if args.admit == "bloom" and args.admit_min_count > 15:
        p.error("--admit bloom counts up to 15: use --admit-min-count <= 15")
    if (args.checkpoint_every or args.incremental_every or args.restore) \
            and not args.checkpoint_dir:
        p.error("--checkpoint-every, --incremental-every and --restore need --checkpoint-dir")
    if args.checkpoint_every < 0 or args.incremental_every < 0:
        p.error("--checkpoint-every and --incremental-every must be >= 0")
    for name in ("batch_size", "dim", "eval_samples", "eval_chunk", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.slow_ms < 0 or (args.slow_ms and args.slow_rank is None):
        p.error("--slow-ms must be >= 0 and needs --slow-rank")
    args.hidden = tuple(int(u) for u in args.hidden.split(",") if u.strip())
    return args


def say(*a):
    if kv.rank() == 0:  # kvcoll: one voice
        print(*a, flush=True)


# ---- data ------------------------------------------------------------------------------

def features(batch: dict) -> dict:
    """A data batch (kvcoll.data format) -> the model's named inputs."""
    cat = batch["categorical"]
    out = {f"C{i + 1}": np.ascontiguousarray(cat[:, i]) for i in range(cat.shape[1])}
    out["numeric"] = batch["numeric"]
    return out


class Synthetic:
    def __init__(self, args, rank, world):
        self.gen = SyntheticCTR(seed=args.seed, vocab=args.vocab)
        self.args, self.rank, self.world = args, rank, world
        self.steps = args.steps or DEFAULTS["steps"]

    def train(self, start=0):
        for step in range(start, self.steps):
            # kvcoll: this rank's slice of global batch `step`, generated alone
            yield self.gen.batch(step, self.args.batch_size, self.rank, self.world)

    def eval_chunks(self, n):
        """This rank's part of the first n eval samples, in chunks: every rank gets the
        same number of chunks (predict is a collective), some possibly empty."""
        ev = self.gen.eval_set(n, self.rank, self.world)  # kvcoll: this rank's part
        per_rank = -(-n // self.world)
        chunks = max(1, -(-per_rank // self.args.eval_chunk))
        size = len(ev["label"])
        for c in range(chunks):
            lo, hi = min(size, c * self.args.eval_chunk), min(size, (c + 1) * self.args.eval_chunk)
            yield {k: v[lo:hi] for k, v in ev.items()}

    def planted(self, batch):
        return self.gen.planted_logit(batch)


class Criteo:
    def __init__(self, args, rank, world):
        self.args, self.rank, self.world = args, rank, world
        self.steps = args.steps
        self.holdout = 0 if args.eval_data else -(-args.eval_samples // args.batch_size)

    def train(self, start=0):
        # kvcoll: every rank reads its slice of each global batch
        it = read_criteo(self.args.data, self.args.batch_size, self.rank, self.world)
        for i, batch in enumerate(it):
            if i < self.holdout + start:  # held out, or trained on before a --restore
                continue
            if self.steps is not None and i - self.holdout >= self.steps:
                return
            yield batch

    def eval_chunks(self, n):
        # Same number of batches on every rank (read_criteo's promise), some maybe empty.
        paths = self.args.eval_data or self.args.data
        seen = 0
        for batch in read_criteo(paths, self.args.batch_size, self.rank, self.world):
            if seen >= n:
                return
            seen += self.args.batch_size
            yield batch

    planted = None


# ---- evaluation ------------------------------------------------------------------------

def gather_rows(local: np.ndarray) -> np.ndarray:
    """Every rank's [n_r, k] float64 rows, concatenated in rank order (on every rank)."""
    rows, _ = runtime.comm().allgatherv(local, op="eval:gather")  # kvcoll:
    return rows


def evaluate(trainer, data, n: int) -> dict:
    """AUC and log loss of the model (and of the planted model, on synthetic data) on
    the first n eval samples, over all ranks."""
    cols = []
    for chunk in data.eval_chunks(n):
        logit = trainer.predict(features(chunk))[:, 0].astype(np.float64)  # kvcoll: collective
        c = [logit, chunk["label"].astype(np.float64)]
        if data.planted is not None:
            c.append(data.planted(chunk) if len(logit) else np.zeros(0))
        cols.append(np.stack(c, axis=1))
    allr = gather_rows(np.concatenate(cols) if cols else np.zeros((0, 2)))
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


def lifecycle_stats(trainer, comm, evict_pauses) -> dict:
    """Per table over all ranks: rows, bytes, load factor, admitted, rejected, evicted,
    dropped gradients and bytes per row beyond its floats; the longest eviction pause
    on any rank. A collective."""
    fields = ("rows", "bytes", "index_slots", "admitted", "rejected", "evicted",
              "dropped_grads", "pending")
    local = [t.stats() for t in trainer.tables.values()]  # kvcoll: this rank's shards
    total = comm.allreduce(np.array([[getattr(s, f) for f in fields] for s in local],
                                    np.float64).reshape(-1), op="train:lifecycle")
    total = total.reshape(len(local), len(fields))
    within = all(t.max_rows is None or s.rows <= t.max_rows
                 for t, s in zip(trainer.tables.values(), local))
    pauses = comm.allgather(np.array([max(evict_pauses, default=0.0), len(evict_pauses),
                                      sum(evict_pauses), within], np.float64),
                            op="train:evict_pause")
    tables = {}
    for (name, t), s, row in zip(trainer.tables.items(), local, total):
        d = {f: int(v) for f, v in zip(fields, row)}
        d["load_factor"] = d["rows"] / max(1, d["index_slots"])
        d["bytes_per_row_overhead"] = \
            (d["bytes"] - d["rows"] * 4 * (s.dim + s.slot_floats)) / d["rows"] if d["rows"] else 0.0
        d["max_rows_per_rank"] = t.max_rows
        tables[name] = d
    calls = int(pauses[0, 1])
    return {"tables": tables,
            "admitted": sum(d["admitted"] for d in tables.values()),
            "rejected": sum(d["rejected"] for d in tables.values()),
            "evicted": sum(d["evicted"] for d in tables.values()),
            "dropped_grads": sum(d["dropped_grads"] for d in tables.values()),
            "evict_calls": calls,
            "max_evict_pause_ms": float(pauses[:, 0].max()) * 1e3,
            "mean_evict_pause_ms": float(pauses[:, 2].sum() / max(1, pauses[:, 1].sum())) * 1e3,
            "within_budget": bool(pauses[:, 3].all())}


def summary_scalar(tag: str, value: float) -> None:
    """tf.summary.scalar without the tensorboard package (which tf.summary.scalar needs
    and requirements.txt does not pin): the same event, with the scalars plugin's
    metadata, written by TensorFlow's own summary op into the default writer."""
    import tensorflow as tf
    from tensorflow.core.framework import summary_pb2

    meta = summary_pb2.SummaryMetadata(data_class=summary_pb2.DATA_CLASS_SCALAR)
    meta.plugin_data.plugin_name = "scalars"
    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=meta)


# ---- progress --------------------------------------------------------------------------

class Progress:
    """Rank 0's progress: a rich bar on a terminal, plus a plain line every --log-every
    steps (readable in CI logs)."""

    def __init__(self, total, rank, bar):
        self.rank0 = rank == 0  # kvcoll: one voice
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


# ---- main ------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    kv.init()  # kvcoll: MPI up; --step-mode / --staleness parsed from sys.argv
    cfg = runtime.config()  # kvcoll:
    rank, world = kv.rank(), kv.size()  # kvcoll:
    bsp = cfg.step_mode == "bsp"
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        if rank == 0:
            print(f"error: --slow-rank {args.slow_rank} is not a rank of {world}",
                  file=sys.stderr, flush=True)
        kv.shutdown()
        return 2
    slow_s = args.slow_ms / 1e3 if args.slow_rank == rank else 0.0

    import tensorflow as tf

    # kvcoll: the ranks on this host share its cores; set before any TensorFlow op runs
    here = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS")
               or world)
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // here))
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from models import build_deepfm, build_wdl

    keras.utils.set_random_seed(args.seed)
    build = {"deepfm": build_deepfm, "wdl": build_wdl}[args.model]

    def embed(field, width):  # kvcoll: one sharded, growable table per field
        return kv.Embedding(field, width, initializer=("normal", 0.0, args.init_std),
                            seed=args.seed, admit_min_count=args.admit_min_count,
                            admit=args.admit, evict_after_steps=args.evict_after_steps,
                            max_rows=args.max_rows_per_table)

    model = build(NUM_FIELDS, NUM_NUMERIC, args.dim, embed, hidden=args.hidden)
    opt = kv.DistributedOptimizer(  # kvcoll: dense: allreduce + Adam; rows: Adagrad in C
        keras.optimizers.Adam(args.lr),
        sparse=kv.optimizers.Adagrad(args.sparse_lr,
                                     initial_accumulator_value=args.sparse_init_accum))
    trainer = kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt)  # kvcoll:
    kv.broadcast_variables(model.variables, root_rank=0)  # kvcoll: same start everywhere

    data = (Criteo if args.data else Synthetic)(args, rank, world)
    if args.restore:  # kvcoll: tables, dense model, optimizer and step, on any world size
        info = kv.restore(args.checkpoint_dir, trainer)
        say(f"restored {info.name} (step {info.step}; a full checkpoint and "
            f"{len(info.chain) - 1} incremental one(s)) from {args.checkpoint_dir} "
            f"in {info.seconds:.1f}s")
    start = trainer.step
    quick_n = min(args.eval_samples, 16384)
    if not bsp and (args.checkpoint_every or args.incremental_every):
        say(f"note: --step-mode {cfg.step_mode}: ranks step independently, so checkpoints "
            "(collectives) are saved only at the end")
    say(f"{args.model} on {world} rank(s), {cfg.step_mode}"
        f"{f' (staleness {cfg.staleness})' if cfg.step_mode == 'ssp' else ''}: "
        f"{NUM_FIELDS} tables of width {args.dim + 1}, "
        f"global batch {args.batch_size} ({even_split(args.batch_size, 0, world)[1]} on "
        f"rank 0), {data.steps or 'all'} steps, "
        f"{'data ' + ' '.join(args.data) if args.data else f'synthetic data (seed {args.seed})'}")

    writer = tf.summary.create_file_writer(args.logdir) if args.logdir and rank == 0 else None
    progress = Progress(data.steps, rank, bar=not args.no_progress)
    saved_at = start if args.restore else None
    losses = []
    train_time = first_step = eval_time = data_time = 0.0
    timings0 = None
    last_log = (1, 0.0)            # (step, train_time) at the previous log line
    # Uneven data: a rank whose data ends calls trainer.finish() and serves the others'
    # steps. Until the first rank runs out, all ranks agree each step that all have a
    # batch; only then may they run collectives of their own (the periodic evaluation).
    # kvcoll: SSP/ASP ranks step independently: no per-step collective at all, so no
    # periodic evaluation or checkpoint either (they are collectives)
    all_have_data = bsp
    own_time = 0.0                 # this rank's own steps (without finish()'s wait)
    own_samples = 0
    comm = runtime.comm()  # kvcoll:
    evicting = args.evict_after_steps is not None or args.max_rows_per_table is not None
    evict_pauses = []              # seconds of each trainer.evict() on this rank
    t_step = time.perf_counter()
    batches = data.train(start)
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        t1 = time.perf_counter()
        if all_have_data:  # kvcoll: one tiny allreduce per step
            have = comm.allreduce(np.array([batch is not None], np.int32), op="train:have_data")
            all_have_data = int(have[0]) == world
        if batch is None:
            break
        if slow_s:
            time.sleep(slow_s)  # --slow-rank: a straggler
        loss = trainer.train_step(features(batch), batch["label"])  # kvcoll: one step
        now = time.perf_counter()
        step = trainer.step
        losses.append((step, loss))
        if step == start + 1:
            first_step = now - t_step
            timings0 = dict(trainer.timings)
        else:
            train_time += now - t_step
            data_time += t1 - t0
            own_time = train_time
            own_samples += len(batch["label"])
        t_step = now
        if writer is not None:
            with writer.as_default(step=step):
                summary_scalar("loss", loss)
        progress.update(step, loss)

        if evicting:  # kvcoll: each table once every --evict-every steps, staggered (local)
            due = [n for i, n in enumerate(trainer.tables) if (step + i) % args.evict_every == 0]
            if due:                                     # (its time counts as training time)
                evict_pauses.append(trainer.evict(tables=due))

        every = args.checkpoint_every
        inc = args.incremental_every
        if args.checkpoint_dir and all_have_data and ((every and step % every == 0)
                                                      or (inc and step % inc == 0)):
            te = time.perf_counter()
            full = bool(every and step % every == 0)
            if evicting:  # kvcoll: evict every table before saving
                trainer.evict()
            info = kv.save(args.checkpoint_dir, trainer, incremental=not full)  # kvcoll: collective
            saved_at = step
            progress.line(f"step {step:5d}  saved {info.kind} checkpoint {info.name}: "
                          f"{info.rows:,} rows, {info.bytes / 2**20:,.1f} MiB, {info.seconds:.2f}s")
            eval_time += time.perf_counter() - te
            t_step = time.perf_counter()       # saving is not training time

        if step % args.log_every == 0 and step != data.steps and all_have_data:
            te = time.perf_counter()
            quick = evaluate(trainer, data, quick_n)  # kvcoll: collective
            stats = trainer.table_stats()  # kvcoll: collective
            rows = sum(s["rows"] for s in stats.values())
            sps = (step - last_log[0]) * args.batch_size / max(1e-9, train_time - last_log[1])
            last_log = (step, train_time)
            recent = np.mean([l for _, l in losses[-args.log_every:]])
            progress.line(f"step {step:5d}  loss {recent:.4f}  auc {quick['eval_auc']:.4f}  "
                          f"{sps:,.0f} samples/s  {rows:,} rows")
            if writer is not None:
                with writer.as_default(step=step):
                    summary_scalar("eval_auc", quick["eval_auc"])
                    summary_scalar("samples_per_sec", sps)
                    summary_scalar("table_rows", rows)
            eval_time += time.perf_counter() - te
            t_step = time.perf_counter()       # evaluation is not training time
        elif not bsp and step % args.log_every == 0 and step != data.steps:
            sps = (step - last_log[0]) * len(batch["label"]) \
                / max(1e-9, train_time - last_log[1])
            last_log = (step, train_time)
            recent = np.mean([l for _, l in losses[-args.log_every:]])
            progress.line(f"step {step:5d}  loss {recent:.4f}  {sps:,.0f} samples/s on rank 0  "
                          f"staleness <= {trainer.staleness_observed}")
    own_steps = n_own = len(losses)
    served = trainer.finish()  # kvcoll: uneven data: serve the other ranks until all are done
    if bsp and trainer.step > start + 1:
        train_time += time.perf_counter() - t_step    # the steps served count as training
    progress.close()
    steps = trainer.step
    final_evict = 0.0
    if evicting:  # kvcoll: every table within its budget at the end (and before the save)
        final_evict = trainer.evict()
    if args.checkpoint_dir and saved_at != steps and steps > 0:
        info = kv.save(args.checkpoint_dir, trainer,  # kvcoll: a collective
                       incremental=bool(args.incremental_every))
        say(f"saved {info.kind} checkpoint {info.name} at step {steps}: {info.rows:,} rows, "
            f"{info.bytes / 2**20:,.1f} MiB in {info.seconds:.2f}s")
    if steps == 0:
        say("error: no training data")
        kv.shutdown()
        return 1

    te = time.perf_counter()
    result = evaluate(trainer, data, args.eval_samples)  # kvcoll: collective
    eval_time += time.perf_counter() - te
    stats = trainer.table_stats()  # kvcoll: rows and bytes summed over all ranks
    lifecycle = lifecycle_stats(trainer, comm, evict_pauses)  # kvcoll: collective
    for name, s in lifecycle["tables"].items():
        stats[name].update(s)
    own_steps = max(0, own_steps - 1)  # the first (tracing) step is not timed
    # kvcoll: every rank's own rate and staleness, gathered once at the end
    rates = comm.allgather(np.array([own_steps / own_time if own_time > 0 else 0.0,
                                     own_samples / own_time if own_time > 0 else 0.0,
                                     n_own, trainer.staleness_observed,
                                     trainer.max_lead], np.float64), op="train:rates")
    timed = max(1, steps - start - 1 if bsp else n_own - 1)
    per_step = {k: (v - (timings0 or {}).get(k, 0.0)) / timed * 1e3
                for k, v in trainer.timings.items()}
    per_step["data"] = data_time / timed * 1e3
    per_step["total"] = train_time / timed * 1e3
    # "tables" is the part of "exchange" spent in the tables' C calls: not added twice
    per_step["other"] = per_step["total"] - sum(v for k, v in per_step.items()
                                                if k not in ("total", "tables"))
    if bsp:
        sps = (timed * args.batch_size / train_time) if steps > start + 1 and train_time > 0 \
            else 0.0
    else:  # the sum of every rank's own rate: the ranks do not wait for each other
        sps = float(rates[:, 1].sum())

    metrics = {
        "model": args.model, "world_size": world, "step_mode": cfg.step_mode,
        "staleness": None if cfg.step_mode == "asp" else cfg.mode.staleness,
        "steps": steps, "served_steps": served,
        "local_steps": [int(x) for x in rates[:, 2]],
        "steps_per_sec": [float(x) for x in rates[:, 0]],
        "max_staleness_observed": int(rates[:, 3].max()),
        "max_clock_lead": int(rates[:, 4].max()),
        "slow_rank": args.slow_rank, "slow_ms": args.slow_ms,
        "global_batch_size": args.batch_size, "dim": args.dim, "hidden": list(args.hidden),
        "lr": args.lr, "sparse_lr": args.sparse_lr, "seed": args.seed,
        "data": args.data or "synthetic",
        "samples_per_sec": sps,
        "train_seconds": train_time, "first_step_seconds": first_step,
        "eval_seconds": eval_time,
        "timings_ms_per_step": per_step,
        "final_loss": float(np.mean([l for _, l in losses[-10:]])) if losses else None,
        "loss_curve": [[s, float(l)] for s, l in losses],
        **result,
        "tables": stats,
        "admit_min_count": args.admit_min_count, "admit": args.admit,
        "evict_after_steps": args.evict_after_steps,
        "max_rows_per_table": args.max_rows_per_table,
        **{k: v for k, v in lifecycle.items() if k != "tables"},
        "final_evict_ms": final_evict * 1e3,
        "table_rows": sum(s["rows"] for s in stats.values()),
        "table_bytes": sum(s["bytes"] for s in stats.values()),
    }
    if args.restore:
        metrics["restored_from_step"] = start
    if args.export_dir:  # kvcoll: a collective; rank 0 writes
        ex = kv.export(args.export_dir, trainer)
        metrics["export_seconds"] = ex["seconds"]
        say(f"exported a SavedModel and the embedding dictionary to {args.export_dir} "
            f"in {ex['seconds']:.1f}s")
    target = None
    if "planted_auc" in result:
        target = 0.5 + 0.8 * (result["planted_auc"] - 0.5)
        metrics["target_auc"] = target
    if rank == 0:
        if args.metrics_out:
            Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.metrics_out).write_text(json.dumps(metrics, indent=1) + "\n")
        if writer is not None:
            with writer.as_default(step=steps):
                summary_scalar("eval_auc", result["eval_auc"])
                summary_scalar("samples_per_sec", sps)
                summary_scalar("table_rows", metrics["table_rows"])
            writer.close()
        print(f"\n{steps} steps of {args.batch_size} on {world} rank(s): "
              f"{sps:,.0f} samples/s ({train_time:.1f}s, first step {first_step:.1f}s)")
        print("per step: " + "  ".join(f"{k} {v:.1f} ms" for k, v in per_step.items()))
        print(f"final loss {metrics['final_loss']:.4f}   eval logloss {result['eval_logloss']:.4f}"
              f" on {result['eval_samples']:,} held-out samples")
        line = f"eval AUC {result['eval_auc']:.4f}"
        if target is not None:
            reached = "reached" if result["eval_auc"] >= target else "NOT reached"
            line += (f"   planted AUC {result['planted_auc']:.4f} (the best possible)   "
                     f"target >= {target:.4f}: {reached}")
        print(line)
        print(f"tables: {metrics['table_rows']:,} rows, {metrics['table_bytes'] / 2**20:,.0f} MiB "
              f"over all ranks")
        if metrics["evict_calls"] or args.admit_min_count > 1:
            print(f"lifecycle: {metrics['admitted']:,} admitted, {metrics['rejected']:,} "
                  f"lookups rejected, {metrics['evicted']:,} evicted, longest eviction pause "
                  f"{metrics['max_evict_pause_ms']:.1f} ms, every table within its budget: "
                  f"{metrics['within_budget']}")
        if args.metrics_out:
            print(f"metrics: {args.metrics_out}")
    trainer.close()
    kv.shutdown()  # kvcoll:
    return 0


if __name__ == "__main__":
    sys.exit(main())
