"""Train DeepFM or Wide & Deep on sharded kvcoll tables over N MPI ranks.

26 categorical fields (one growable table each, sharded over the ranks) and 13 numeric
ones, on a built-in synthetic CTR data set: Zipf ids over 10^7 per field and labels
drawn from a planted model, so the best achievable AUC (planted_auc) is known. The
global batch of step t depends only on --seed and t, never on the world size: each rank
generates just its own slice. --data PATH reads Criteo TSV files instead; unless
--eval-data is given, the start of the files is held out for evaluation and not trained
on: --eval-samples lines, or --holdout-fraction of the lines when the files are too
small for that (rounded up to whole global batches; the size is printed).

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
import gzip
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcoll as kv  # kvcoll:
from harness import (DemoRun, LoggedCheckpoint, Progress, evaluate, lifecycle_stats,  # demo
                     report, say)
from kvcoll import runtime  # kvcoll:
from kvcoll.data import SyntheticCTR, even_split, read_criteo  # kvcoll: per-rank slices
from kvcoll.keras import engine_of

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
    p.add_argument("--wire-dtype", choices=("fp32", "fp16", "bf16"), default=None,
                   help="rows and row gradients on the wire (default: KVCOLL_WIRE_DTYPE or "
                        "fp32; docs/wire-dtype.md)")
    p.add_argument("--pipeline", choices=("on", "off", "semi"), default=None,
                   help="pipelined steps; semi: the next batch's rows fetched while a step "
                        "computes, one step stale (default: KVCOLL_PIPELINE or on; "
                        "docs/performance.md)")
    p.add_argument("--xla", choices=("on", "off"), default=None,
                   help="the dense step under XLA (default: KVCOLL_XLA or off)")
    p.add_argument("--huge-pages", choices=("on", "off"), default=None,
                   help="the tables' memory advised MADV_HUGEPAGE (default: "
                        "KVCOLL_HUGE_PAGES or on; off for VMs whose host backs memory "
                        "lazily: docs/performance.md)")
    p.add_argument("--slow-rank", type=int, default=None, metavar="R",
                   help="debug: rank R sleeps --slow-ms per step (a straggler, for tests and "
                        "benchmarks)")
    p.add_argument("--slow-ms", type=float, default=0.0, metavar="M",
                   help="milliseconds --slow-rank sleeps per step")
    p.add_argument("--jitter-ms", type=float, default=0.0, metavar="M",
                   help="debug: every rank sleeps a random time before each step, "
                        "exponential with a mean of M ms, drawn from a generator seeded "
                        "by --seed and the rank (transient delays, for the step modes' "
                        "benchmark)")
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
    p.add_argument("--eval-samples", type=int, default=100_000,
                   help="samples to evaluate on (with --data alone: the hold-out at most)")
    p.add_argument("--holdout-fraction", type=float, default=0.1, metavar="F",
                   help="with --data and no --eval-data: hold out at most this fraction "
                        "of the lines (a small file still trains)")
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
    if not 0 < args.holdout_fraction < 1:
        p.error("--holdout-fraction must be between 0 and 1")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.slow_ms < 0 or (args.slow_ms and args.slow_rank is None):
        p.error("--slow-ms must be >= 0 and needs --slow-rank")
    if not 0 <= args.jitter_ms < float("inf"):
        p.error(f"--jitter-ms must be a number >= 0, got {args.jitter_ms}")
    args.hidden = tuple(int(u) for u in args.hidden.split(",") if u.strip())
    return args


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
            # kvcoll: this rank's slice of global batch `step`, generated alone (for the
            # world it is in now: an elastic run's survivors take larger slices)
            yield self.gen.batch(step, self.args.batch_size, kv.rank(), kv.size())

    def eval_chunks(self, n):
        """This rank's part of the first n eval samples (model.predict batches it)."""
        yield self.gen.eval_set(n, self.rank, self.world)  # kvcoll: this rank's part

    def planted(self, batch):
        return self.gen.planted_logit(batch)


def count_lines(paths, stop_after: int) -> int:
    """Lines in the files (plain or .gz), counting no further than stop_after."""
    lines = 0
    for path in paths:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                lines += block.count(b"\n")
                if lines >= stop_after:
                    return lines
    return lines


class Criteo:
    """Criteo TSV files (--data): global batch t is lines [t*B, (t+1)*B) of the files, in
    order, whatever the number of ranks; unless --eval-data is given, the start of the
    files is held out for evaluation: --eval-samples lines, or --holdout-fraction of
    them when the files hold fewer than --eval-samples / --holdout-fraction lines, in
    whole global batches."""

    def __init__(self, args, rank, world):
        self.args, self.rank, self.world = args, rank, world
        self.steps = args.steps
        self.eval_n = args.eval_samples
        self.holdout = 0
        if not args.eval_data:
            enough = math.ceil(args.eval_samples / args.holdout_fraction)
            self.lines = count_lines(args.data, enough)
            want = args.eval_samples if self.lines >= enough else \
                max(1, math.ceil(self.lines * args.holdout_fraction))
            self.holdout = -(-want // args.batch_size)   # whole global batches
            self.eval_n = min(self.holdout * args.batch_size, self.lines)
            small = "" if self.lines >= enough else \
                f" (--holdout-fraction {args.holdout_fraction:g} of {self.lines:,} lines)"
            say(f"holding out the first {self.eval_n:,} lines of --data for evaluation"
                f"{small}; training on the rest")

    def train(self, start=0):
        # kvcoll: this rank's slice of each global batch: every rank scans the line ends,
        # parses only its own lines (pyarrow, ids in C), a background thread reading ahead;
        # batches before start_step (held out, or trained on before a --restore) unparsed
        reader = read_criteo(self.args.data, self.args.batch_size, self.rank, self.world,
                             start_step=self.holdout + start)
        for i, batch in enumerate(reader):
            if self.steps is not None and i + start >= self.steps:
                return
            yield batch

    def eval_chunks(self, n):
        # Same number of batches on every rank (split="global"), some maybe empty.
        paths = self.args.eval_data or self.args.data
        n = min(n, self.eval_n)   # never past the hold-out into the training lines
        seen = 0
        for batch in read_criteo(paths, self.args.batch_size, self.rank, self.world):
            if seen >= n:
                return
            seen += self.args.batch_size
            yield batch

    planted = None

    def why_empty(self) -> str:
        """Why no batch was trained on (the answer to "no training data")."""
        if not self.holdout:
            return "the --data files hold no line"
        a = self.args
        return (f"the --data files hold {self.lines:,} lines and the evaluation hold-out "
                f"takes the first {self.holdout * a.batch_size:,} (at least one whole global "
                f"batch of --batch-size {a.batch_size:,}), leaving none to train on; pass a "
                f"smaller --batch-size, or --eval-data PATH to evaluate on other files")


# ---- main ------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    kv.init()  # kvcoll: MPI up; --step-mode / --staleness parsed from sys.argv
    rank, world = kv.rank(), kv.size()  # kvcoll:
    mode = runtime.config().mode
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        say(f"error: --slow-rank {args.slow_rank} is not a rank of {world}")
        kv.shutdown()
        return 2

    import keras
    import tensorflow as tf  # (after kv.init: it gave TensorFlow this rank's share of cores)

    from models import build_deepfm, build_wdl

    keras.utils.set_random_seed(args.seed)
    build = {"deepfm": build_deepfm, "wdl": build_wdl}[args.model]

    def embed(field, width):  # kvcoll: one sharded, growable table per field
        return kv.Embedding(field, width, initializer=("normal", 0.0, args.init_std),
                            seed=args.seed, admit_min_count=args.admit_min_count,
                            admit=args.admit, evict_after_steps=args.evict_after_steps,
                            max_rows=args.max_rows_per_table)

    model = kv.distribute(build(NUM_FIELDS, NUM_NUMERIC, args.dim, embed,  # kvcoll: fit runs
                                hidden=args.hidden))                       # kvcoll's steps
    model.compile(
        optimizer=kv.DistributedOptimizer(  # kvcoll: dense: allreduce + Adam; rows: Adagrad in C
            keras.optimizers.Adam(args.lr),
            sparse=kv.optimizers.Adagrad(args.sparse_lr,
                                         initial_accumulator_value=args.sparse_init_accum)),
        loss=keras.losses.BinaryCrossentropy(from_logits=True))

    data = (Criteo if args.data else Synthetic)(args, rank, world)
    start = 0
    if args.restore:  # kvcoll: tables, dense model, optimizer and step, on any world size
        info = kv.restore(args.checkpoint_dir, model)
        start = info.step
        say(f"restored {info.name} (step {info.step}; a full checkpoint and "
            f"{len(info.chain) - 1} incremental one(s)) from {args.checkpoint_dir} "
            f"in {info.seconds:.1f}s")
    say(f"{args.model} on {world} rank(s), {mode.name}"
        f"{f' (staleness {mode.staleness})' if mode.name == 'ssp' else ''}: "
        f"{NUM_FIELDS} tables of width {args.dim + 1}, "
        f"global batch {args.batch_size} ({even_split(args.batch_size, 0, world)[1]} on "
        f"rank 0), {data.steps or 'all'} steps, "
        f"{'data ' + ' '.join(args.data) if args.data else f'synthetic data (seed {args.seed})'}")

    # What the demo watches and reports lives in harness.py, apart from the training.
    writer = tf.summary.create_file_writer(args.logdir) if args.logdir and rank == 0 else None
    progress = Progress(data.steps, bar=not args.no_progress)
    evicting = args.evict_after_steps is not None or args.max_rows_per_table is not None
    evict = kv.callbacks.Evict(args.evict_every) if evicting else None  # kvcoll: staggered
    demo = DemoRun(args, data, features, progress, writer, evict=evict,
                   slow_s=args.slow_ms / 1e3 if args.slow_rank == rank else 0.0,
                   jitter_s=args.jitter_ms / 1e3, jitter_seed=(args.seed, rank),
                   total=data.steps)
    callbacks = [demo] + ([evict] if evict else [])
    ck = None
    if args.checkpoint_dir:  # kvcoll: full / incremental saves, and one at the end
        ck = LoggedCheckpoint(progress, args.checkpoint_dir,
                              every_n_steps=args.checkpoint_every or None,
                              incremental_every=args.incremental_every or None)
        ck._last = start if args.restore else None
        callbacks.append(ck)
    history = model.fit(demo.timed((features(b), b["label"]) for b in data.train(start)),
                        epochs=1, verbose=0, callbacks=callbacks)  # kvcoll: my part of it
    progress.close()
    eng = engine_of(model)
    if history.preempted:  # kvcoll: SIGTERM: every rank stopped after one step and saved
        kv.shutdown()
        return 0
    steps = eng.step
    if steps == 0:
        why = data.why_empty() if hasattr(data, "why_empty") else "--steps is 0"
        say(f"error: no training data: {why}")
        kv.shutdown()
        return 1
    if ck is not None and ck.saves and ck.saves[-1].step == steps:
        info = ck.saves[-1]
        say(f"saved {info.kind} checkpoint {info.name} at step {steps}: {info.rows:,} rows, "
            f"{info.bytes / 2**20:,.1f} MiB in {info.seconds:.2f}s")

    te = time.perf_counter()
    result = evaluate(model, data, getattr(data, "eval_n", args.eval_samples),  # kvcoll:
                      features)                                           # collective
    eval_time = demo.eval_time + time.perf_counter() - te
    lifecycle = lifecycle_stats(eng, evict.pauses[:-1] if evict else [])  # kvcoll: collective
    stats = {name: dict(s) for name, s in lifecycle["tables"].items()}
    own_steps = max(0, len(demo.losses) - 1)  # the first (tracing) step is not timed
    # kvcoll: every rank's own rate and staleness, gathered once at the end
    ex = eng.loop.ex
    rates = kv.allgather(np.array([[own_steps / demo.own_time if demo.own_time > 0 else 0.0,
                                    demo.own_samples / demo.own_time if demo.own_time > 0
                                    else 0.0, len(demo.losses),
                                    getattr(ex, "staleness_observed", 0),
                                    getattr(ex, "max_lead", 0), demo.samples]], np.float64))
    per_step = demo.per_step()
    timed = max(1, steps - start - 1 if eng.synchronous else len(demo.losses) - 1)
    if eng.synchronous:
        sps = timed * args.batch_size / demo.train_time if demo.train_time > 0 else 0.0
    else:  # the sum of every rank's own rate: the ranks do not wait for each other
        sps = float(rates[:, 1].sum())
    losses = demo.losses
    metrics = {
        "model": args.model, "world_size": world, "step_mode": mode.name,
        "staleness": None if mode.name == "asp" else mode.staleness,
        "steps": steps, "served_steps": demo.served,
        "local_steps": [int(x) for x in rates[:, 2]],
        "local_samples": [int(x) for x in rates[:, 5]],
        "steps_per_sec": [float(x) for x in rates[:, 0]],
        "max_staleness_observed": int(rates[:, 3].max()),
        "max_clock_lead": int(rates[:, 4].max()),
        "slow_rank": args.slow_rank, "slow_ms": args.slow_ms, "jitter_ms": args.jitter_ms,
        "global_batch_size": args.batch_size, "dim": args.dim, "hidden": list(args.hidden),
        "lr": args.lr, "sparse_lr": args.sparse_lr, "seed": args.seed,
        "data": args.data or "synthetic",
        "samples_per_sec": sps,
        "train_seconds": demo.train_time, "first_step_seconds": demo.first_step,
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
        "final_evict_ms": (evict.pauses[-1] if evict else 0.0) * 1e3,
        "table_rows": sum(s["rows"] for s in stats.values()),
        "table_bytes": sum(s["bytes"] for s in stats.values()),
    }
    if args.restore:
        metrics["restored_from_step"] = start
    if args.export_dir:  # kvcoll: a collective; rank 0 writes
        ex = kv.export(args.export_dir, model)
        metrics["export_seconds"] = ex["seconds"]
        say(f"exported a SavedModel and the embedding dictionary to {args.export_dir} "
            f"in {ex['seconds']:.1f}s")
    report(metrics, args, writer)
    kv.shutdown()  # kvcoll:
    return 0


if __name__ == "__main__":
    sys.exit(main())
