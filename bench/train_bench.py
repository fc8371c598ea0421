"""Training throughput: kvcoll vs a fixed-vocabulary Horovod-style baseline, 1 and 2 ranks.

    python -m bench train            # full: a few minutes
    python -m bench train --quick    # a smoke test

In one run, on the same synthetic data, model (DeepFM, examples/models.py) and
hyperparameters, with one TensorFlow thread per rank (every rank gets the same thread
budget, so 1 -> 2 ranks measures scaling, not TensorFlow's own threading):

- kvcoll on 1 and 2 ranks (kv.Trainer, BSP);
- baseline on 1 and 2 ranks: tf.keras.layers.Embedding over ids hashed modulo 10^6 rows
  per field, sparse Adagrad on the rows a batch touches, dense gradients allreduced and
  the embeddings' sparse gradients allgathered, as Horovod does;
- baseline-gather: the same, but reading rows with a ResourceGather on the underlying
  variable (Keras 3's Embedding.call converts the whole table to a tensor every step on
  TensorFlow 2.21, which dominates the plain baseline's step time);
- limit: kvcoll's compiled dense step alone, fed ready-made rows, at the per-rank batch
  of the 1- and 2-rank runs (no table, no exchange): what kvcoll can approach. At the
  2-rank batch it is measured twice: in one process on an otherwise idle machine, and
  as two processes at once (each alone, no communication), which is what each rank of
  a 2-rank run can approach when both cores are busy;
- exchange alone on 1 and 2 ranks: the same batches' pulls and pushes through kvcoll's
  exchange and tables with a fixed gradient and no TensorFlow step. limit / (limit +
  exchange alone) bounds what kvcoll can reach on this machine even with no glue, no
  data time and no cache effects;
- kvcoll on 2 ranks and its limit (two processes at once) again with the DeepFM
  paper's MLP, 400-400-400 (--train-wide), instead of models.py's lighter default: the
  sparse side costs the same per step whatever the MLP, so how close kvcoll gets to
  the limit depends on how much dense work a step has. These records carry "variant".

- kvcoll from a Criteo TSV file: the warm-up and timed steps' synthetic samples written
  as Criteo TSV (bench/data_bench.py's write_criteo; about 335 MB at the full size) and
  read back by kvcoll.data.read_criteo, in alternating pairs with the synthetic run on 1
  and 2 ranks (--train-file-pairs; --train-file-only runs just these). Target: the
  file-backed run at least 95% of the synthetic one's samples/s. Written to
  train_file.json and train_file.md.

The kvcoll records also carry how much the shards' rows grew per step and how fast the
machine hands a process new memory (first_touch_gbps, measured after the run): their
ratio is the part of a step spent having the kernel (on a VM, also its host) supply the
pages the new rows land in.

- pipelined vs unpipelined, XLA vs plain (--train-pipeline-pairs; --train-pipeline-only
  runs just these): kvcoll's loop (kv.Trainer.train_next over an iterator) and model.fit
  with the pipeline on and off, and the loop with the dense step under XLA and plain,
  in interleaved pairs (A B A B ...) on 1 process x 2 threads and 2 ranks x 1 thread,
  each pair's ratio, the median; and whether the pipelined run's loss and AUC equal
  the unpipelined one's (the same steps). Written to pipeline.json and pipeline.md.

- kvcoll on 1 and on 2 ranks again, in interleaved rounds (--train-ranks-rounds;
  --train-ranks-only runs just these): the 1 -> 2 ranks ratio as the median of the
  rounds' ratios (one launch each moved it from 1.09x to 1.60x on a shared machine),
  unpipelined and pipelined, and each phase's median on 1 and 2 ranks beside half its
  1-rank time. Target: >= 1.8x.
  Written to train_ranks.json and train_ranks.md.

Writes bench/results/train.json, train.md, train.png, train_file.json, train_file.md,
train_ranks.json, train_ranks.md, pipeline.json and pipeline.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from . import common

WORKER = os.path.join(common.ROOT, "bench", "train_worker.py")


def add_arguments(p) -> None:
    g = p.add_argument_group("train")
    g.add_argument("--train-steps", type=int, default=300, help="timed steps per run")
    g.add_argument("--train-batch", type=int, default=4096, help="global batch")
    g.add_argument("--train-wide", default="400,400,400",
                   help="the second MLP kvcoll and its limit run with on 2 ranks ('' skips)")
    g.add_argument("--horovod", action="store_true",
                   help="only the Horovod lane's comparison (TensorFlow 2.15 + Horovod): kvcoll "
                   "on 2 ranks with its own dense allreduce and with Horovod's, and one job "
                   "alternating them with Open MPI spinning and yielding; interleaved rounds; "
                   "writes train-horovod.json/.md")
    g.add_argument("--train-file-pairs", type=int, default=3,
                   help="synthetic / Criteo-file kvcoll pairs per world size (0 skips)")
    g.add_argument("--train-file-only", action="store_true",
                   help="only the file-backed pairs (writes train_file.json and .md alone)")
    g.add_argument("--train-pipeline-pairs", type=int, default=3,
                   help="pipeline on/off and XLA on/off pairs per shape (0 skips)")
    g.add_argument("--train-pipeline-only", action="store_true",
                   help="only the pipeline and XLA pairs (writes pipeline.json and .md)")
    g.add_argument("--train-dense-only", action="store_true",
                   help="only the dense step taken apart, plain and XLA, oneDNN on and off "
                        "(writes dense.json and .md)")
    g.add_argument("--train-dense-pairs", type=int, default=3,
                   help="oneDNN on/off pairs of the dense probe (0 skips)")
    g.add_argument("--train-ranks-rounds", type=int, default=3,
                   help="interleaved rounds of kvcoll on 1 and on 2 ranks: the 1 -> 2 ranks "
                   "ratio as the median of the rounds' (0 skips; writes train_ranks.json "
                   "and .md)")
    g.add_argument("--train-ranks-only", action="store_true",
                   help="only the rounds of kvcoll on 1 and 2 ranks")


def _mpirun(world: int, args: list[str], timeout: float, env_extra=None) -> None:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    export = [a for name in (env_extra or {}) for a in ("-x", name)]
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(world), *export,
           sys.executable, WORKER, *args]
    env = dict(os.environ, **(env_extra or {}), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def run(args) -> None:
    if args.horovod:
        return run_horovod(args)
    steps = 20 if args.quick else args.train_steps
    batch = 1024 if args.quick else args.train_batch
    evals = 8192 if args.quick else 100_000
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    if args.train_dense_pairs and not (args.train_file_only or args.train_pipeline_only
                                       or args.train_ranks_only):
        recs = dense_pairs(steps, batch, 1 if args.quick else args.train_dense_pairs)
        common.publish(out_dir, "dense", recs, lambda m: dense_markdown(recs, m))
        if args.train_dense_only:
            return
    if args.train_pipeline_pairs and not (args.train_file_only or args.train_ranks_only):
        n = 1 if args.quick else args.train_pipeline_pairs
        recs = ab_runs(steps, batch, 8192 if args.quick else 50_000, 2 if args.quick else 10)
        recs += pipeline_pairs(steps, batch, 8192 if args.quick else 50_000, n)
        common.publish(out_dir, "pipeline", recs,
                       lambda m: pipeline_markdown(recs, steps, batch, m))
        if args.train_pipeline_only:
            return
    if args.train_ranks_rounds and not (args.train_file_only or args.train_pipeline_only):
        recs = ranks_rounds(steps, batch, 8192, 1 if args.quick else args.train_ranks_rounds,
                            wait=0 if args.quick else 120)
        common.publish(out_dir, "train_ranks", recs,
                       lambda m: ranks_markdown(recs, steps, batch, m))
        if args.train_ranks_only:
            return
    pairs = 1 if args.quick else args.train_file_pairs
    if pairs:
        file_records = file_pairs(steps, batch, evals, pairs, wait=0 if args.quick else 300)
        common.publish(out_dir, "train_file", file_records,
                       lambda m: file_markdown(file_records, steps, batch, m))
    if args.train_file_only:
        return
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = [(impl, world) for world in (1, 2)
                for impl in ("kvcoll", "baseline", "baseline-gather")]
        for impl, world in plan:
            path = os.path.join(tmp, f"{impl}{world}.json")
            print(f"[train] {impl} on {world} rank(s), {steps} steps of {batch}", flush=True)
            _mpirun(world, ["--impl", impl, "--steps", str(steps), "--batch-size", str(batch),
                            "--eval-samples", str(evals), "--out", path], timeout=3600)
            records.append(json.load(open(path)))
        for world in (1, 2):
            path = os.path.join(tmp, f"exchange{world}.json")
            print(f"[train] exchange alone on {world} rank(s)", flush=True)
            _mpirun(world, ["--impl", "exchange", "--steps", str(steps), "--batch-size",
                            str(batch), "--out", path], timeout=3600)
            records.append(json.load(open(path)))
        for procs, per_rank in ((1, batch), (1, batch // 2), (2, batch // 2)):
            path = os.path.join(tmp, f"limit{procs}x{per_rank}.json")
            print(f"[train] limit at a per-rank batch of {per_rank}, {procs} process(es) at once",
                  flush=True)
            _mpirun(procs, ["--impl", "limit", "--steps", str(steps), "--batch-size",
                            str(per_rank), "--out", path], timeout=3600)
            records.append(json.load(open(path)))
        if args.train_wide:
            variant = f"MLP {args.train_wide.replace(',', '-')}"
            for impl, extra in (("kvcoll", ["--eval-samples", str(evals)]),
                                ("limit", ["--batch-size", str(batch // 2)])):
                path = os.path.join(tmp, f"{impl}-wide.json")
                print(f"[train] {impl} on 2 ranks with the {variant}", flush=True)
                _mpirun(2, ["--impl", impl, "--steps", str(steps), "--batch-size", str(batch),
                            *extra, "--hidden", args.train_wide, "--out", path], timeout=3600)
                records.append(dict(json.load(open(path)), variant=variant))
    common.publish(out_dir, "train", records, lambda m: markdown(records, steps, batch, m))
    png = os.path.join(out_dir, "train.png")
    chart(records, png)
    print(f"[train] wrote {png}")


# (what, impl, the flags of A, the flags of B): B over A is the ratio reported
PIPELINE_COMPARISONS = (
    ("pipeline, loop", "kvcoll", ["--prefetch", "off"], ["--prefetch", "on"]),
    ("pipeline, fit", "fit", ["--prefetch", "off"], ["--prefetch", "on"]),
    ("XLA, loop", "kvcoll", ["--xla", "off"], ["--xla", "on"]),
)
SHAPES = ((1, 2), (2, 1))      # (ranks, TensorFlow threads per rank): the peers' shapes


DENSE_PIECES = (("model", "the model's forward and backward alone"),
                ("grads", "+ kvcoll's gradient outputs (flat dense gradient, gathered rows)"),
                ("train_fn", "+ the metrics: kvcoll's compiled train function"),
                ("train", "+ inputs in, outputs out, gather_grad in C, finite checks "
                          "(compute.train)"),
                ("gather", "gather_grad alone (inside the line above)"),
                ("apply", "the dense optimizer's apply and the logs (compute.apply)"))


def dense_pairs(steps: int, batch: int, pairs: int) -> list[dict]:
    """bench/train_worker.py --impl dense (plain and XLA timed in one process, interleaved)
    in fresh processes alternating oneDNN's custom ops on and off (TF_ENABLE_ONEDNN_OPTS
    1 / 0), 1 process x 2 TensorFlow threads, the global batch on one process."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            for onednn in ("1", "0"):
                busy = common.busy_cores(0.5)
                path = os.path.join(tmp, "dense.json")
                print(f"[train] the dense step taken apart, oneDNN {onednn}, pair {pair + 1} "
                      f"(others busy {busy:.2f} CPUs)", flush=True)
                env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
                proc = subprocess.run([sys.executable, WORKER, "--impl", "dense", "--steps",
                                       str(steps), "--batch-size", str(batch), "--threads", "2",
                                       "--dim", "15", "--out", path], env=env, timeout=3600,
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"dense probe failed:\n{proc.stderr[-3000:]}")
                with open(path, encoding="utf-8") as f:
                    records.append(dict(json.load(f), pair=pair, busy_before=round(busy, 2)))
    return records


def dense_markdown(records, machine) -> str:
    on = [r for r in records if r["onednn"] == "1"]
    off = [r for r in records if r["onednn"] == "0"]
    med = statistics.median
    lines = [
        "# The dense step taken apart: plain, XLA, oneDNN",
        "",
        f"`./dev bench train --train-dense-only` — DeepFM (dim 15, MLP "
        f"{'-'.join(map(str, records[0]['hidden']))}), a batch of {records[0]['batch']} on one "
        f"process with 2 TensorFlow threads, ready-made rows of real batches (8 of them, "
        f"their shapes compiled first); each piece timed over {records[0]['reps']} steps, 7 "
        f"rounds interleaved piece after piece, plain then XLA, in one process; ms a step, "
        f"the median of the rounds (then of the {len(on)} processes). Processes alternate "
        f"oneDNN's custom ops on (TensorFlow's default here) and off. Other processes used "
        f"{med(r['busy_before'] for r in records):.2f} CPUs (median) before them. "
        f"{machine['cpu']}, {machine['cores']} cores, TensorFlow "
        f"{machine.get('tensorflow', '?')}, {machine.get('date', '')}.",
        "",
        "| piece | plain ms | XLA ms | XLA / plain (median of rounds) | plain, oneDNN off ms |"
        " oneDNN off / on |",
        "|---|---:|---:|---:|---:|---:|"]
    for key, what in DENSE_PIECES:
        p = med(r["ms"]["plain"][key] for r in on)
        x = med(r["ms"]["xla"][key] for r in on)
        ratio = med(r["xla_over_plain"][key] for r in on)
        p0 = med(r["ms"]["plain"][key] for r in off) if off else float("nan")
        lines.append(f"| {key}: {what} | {p:.1f} | {x:.1f} | {ratio:.2f} | {p0:.1f} | "
                     f"{p0 / p:.2f} |")
    lines += ["", "Each row but `gather` and `apply` includes the row above it.", ""]
    return "\n".join(lines)


AB = (("pipeline", "pipeline, loop (kv.Trainer.train_next)"),
      ("pipeline-fit", "pipeline, model.fit"), ("xla", "XLA, loop"))


def ab_runs(steps: int, batch: int, evals: int, block: int) -> list[dict]:
    """In one launch: A (off) and B (on) as two trainers of the same model on the same
    batches, in alternating blocks of `block` steps (bench/train_worker.py --impl ab),
    for each comparison and shape: B / A per pair of blocks under the same load."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for which, what in AB:
            for world, threads in SHAPES:
                busy = common.busy_cores(0.5)
                path = os.path.join(tmp, "ab.json")
                print(f"[train] A/B blocks: {what} on {world} x {threads} (others busy "
                      f"{busy:.2f} CPUs)", flush=True)
                _mpirun(world, ["--impl", "ab", "--ab", which, "--ab-block", str(block),
                                "--steps", str(steps), "--batch-size", str(batch),
                                "--threads", str(threads), "--dim", "15", "--eval-samples",
                                str(evals), "--out", path], timeout=3600)
                with open(path, encoding="utf-8") as f:
                    records.append(dict(json.load(f), comparison=what,
                                        busy_before=round(busy, 2)))
    return records


def ab_lines(records) -> list[str]:
    rs = [r for r in records if r.get("impl") == "ab"]
    if not rs:
        return []
    lines = [
        "## A and B in one process, alternating blocks",
        "",
        f"Two trainers of the same model (the same initial weights) in one launch, each "
        f"over its own iterator of the same batches, stepping alternating blocks of "
        f"{rs[0]['block']} steps (A B A B ...; a barrier around each block), so both see "
        f"the machine's load alike: B / A is the ratio of a pair of blocks' speeds; the "
        f"median and the quartiles over the {len(rs[0]['ratios'])} pairs. A: off, B: on.",
        "",
        "| comparison | ranks x threads | B / A (median) | quartiles | samples/s A, B "
        "(median block) | final loss A, B | eval AUC A, B | others busy before |",
        "|---|---|---:|---|---|---|---|---:|"]
    for r in rs:
        q = statistics.quantiles(r["ratios"], n=4) if len(r["ratios"]) > 1 else [r["ratio"]] * 3
        sps, loss, auc = r["samples_per_sec"], r["final_loss"], r["eval_auc"]
        lines.append(
            f"| {r['comparison']} | {r['world_size']} x {r['threads_per_rank']} | "
            f"{r['ratio']:.3f} | {q[0]:.2f}-{q[2]:.2f} | {sps['A']:,.0f}, {sps['B']:,.0f} | "
            f"{loss['A']:.6f}, {loss['B']:.6f} | {auc['A']:.4f}, {auc['B']:.4f} | "
            f"{r['busy_before']:.2f} |")
    return lines + [""]


def pipeline_pairs(steps: int, batch: int, evals: int, pairs: int) -> list[dict]:
    """Each comparison on each shape: `pairs` runs of A and B alternating (A B A B ...),
    each a fresh launch of bench/train_worker.py; the CPUs other processes used just
    before each run are recorded (the machine is shared)."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, impl, flags_a, flags_b in PIPELINE_COMPARISONS:
            for world, threads in SHAPES:
                for pair in range(pairs):
                    for side, flags in (("A", flags_a), ("B", flags_b)):
                        busy = common.busy_cores(0.5)
                        path = os.path.join(tmp, "run.json")
                        print(f"[train] {what}: {' '.join(flags)} on {world} x {threads}, pair "
                              f"{pair + 1} (others busy {busy:.2f} CPUs)", flush=True)
                        _mpirun(world, ["--impl", impl, "--steps", str(steps), "--batch-size",
                                        str(batch), "--threads", str(threads), "--dim", "15",
                                        "--eval-samples", str(evals), *flags, "--out", path],
                                timeout=3600)
                        with open(path, encoding="utf-8") as f:
                            rec = json.load(f)
                        records.append(dict(rec, comparison=what, side=side, pair=pair,
                                            flags=flags, threads_per_rank=threads,
                                            busy_before=round(busy, 2)))
    return records


def pipeline_summary(records) -> list[dict]:
    """Per comparison and shape: B / A samples/s per pair, their median, and the final
    losses and AUCs of both sides."""
    records = [r for r in records if r.get("impl") != "ab"]
    out = []
    for what, _, flags_a, flags_b in PIPELINE_COMPARISONS:
        for world, threads in SHAPES:
            rs = [r for r in records if r["comparison"] == what and r["world_size"] == world
                  and r["threads_per_rank"] == threads]
            if not rs:
                continue
            a = {r["pair"]: r for r in rs if r["side"] == "A"}
            b = {r["pair"]: r for r in rs if r["side"] == "B"}
            ratios = [b[p]["samples_per_sec"] / a[p]["samples_per_sec"] for p in a if p in b]
            out.append({
                "comparison": what, "ranks": world, "threads": threads,
                "a": " ".join(flags_a), "b": " ".join(flags_b), "ratios": ratios,
                "ratio": statistics.median(ratios) if ratios else None,
                "a_sps": statistics.median(r["samples_per_sec"] for r in a.values()),
                "b_sps": statistics.median(r["samples_per_sec"] for r in b.values()),
                "a_loss": [r["final_loss"] for r in a.values()],
                "b_loss": [r["final_loss"] for r in b.values()],
                "a_auc": [r["eval_auc"] for r in a.values()],
                "b_auc": [r["eval_auc"] for r in b.values()],
                "a_ms": {k: statistics.median(r["ms_per_step"].get(k, 0.0) for r in a.values())
                         for k in ("compute", "exchange", "total")},
                "b_ms": {k: statistics.median(r["ms_per_step"].get(k, 0.0) for r in b.values())
                         for k in ("compute", "exchange", "total")},
                "busy": max(r["busy_before"] for r in rs)})
    return out


def pipeline_markdown(records, steps, batch, machine) -> str:
    s = pipeline_summary(records)
    busy = [r["busy_before"] for r in records]
    lines = [
        "# Pipelined steps and the XLA dense step, each against its baseline",
        "",
        f"`./dev bench train --train-pipeline-only` — DeepFM (rows of 16 floats: dim 15 + "
        f"the first-order weight), global batch {batch}, BSP, SyntheticCTR, on 1 process x "
        f"2 TensorFlow threads and 2 ranks x 1 thread. {machine['cpu']}, "
        f"{machine['cores']} cores, TensorFlow {machine.get('tensorflow', '?')}, "
        f"{machine.get('date', '')}.",
        "",
        *ab_lines(records),
        "## Separate launches, alternating",
        "",
        f"{steps} timed steps per run; A and B alternate (A B A B ...), each a fresh launch; "
        f"the ratio is B / A samples/s within a pair. The machine is shared: other "
        f"processes used {statistics.median(busy):.2f} CPUs (median; at most "
        f"{max(busy):.2f}) just before the runs.",
        "",
        "| comparison | ranks x threads | A | B | B / A per pair | B / A (median) | "
        "samples/s A, B (median) | ms/step total A, B | final loss A, B | eval AUC A, B |",
        "|---|---|---|---|---|---:|---|---|---|---|",
    ]
    for d in s:
        pairs = ", ".join(f"{x:.2f}" for x in d["ratios"])
        lines.append(
            f"| {d['comparison']} | {d['ranks']} x {d['threads']} | `{d['a']}` | `{d['b']}` | "
            f"{pairs} | {d['ratio']:.2f} | {d['a_sps']:,.0f}, {d['b_sps']:,.0f} | "
            f"{d['a_ms']['total']:.1f}, {d['b_ms']['total']:.1f} | "
            f"{d['a_loss'][0]:.6f}, {d['b_loss'][0]:.6f} | "
            f"{d['a_auc'][0]:.4f}, {d['b_auc'][0]:.4f} |")
    lines += [
        "",
        "- pipeline: the same steps on the same batches, so the final loss and AUC of A and "
        "B agree (to float order of the sums, which does not depend on the pipeline); XLA "
        "fuses and approximates: its loss and AUC move a little from the plain run's.",
        "- ms/step: the wall time of a step; with the pipeline the next batch's reading, "
        "preparation, routing and id exchange run beside the step's compute.",
        "",
    ]
    return "\n".join(lines)


# The Horovod lane's jobs per round: kvcoll alone (no Horovod in the job), kvcoll with
# Horovod's allreduce for the dense gradients (Open MPI yielding when idle, as kvcoll
# sets it inside Horovod jobs: kvcoll.keras._horovod), and one job alternating blocks of
# steps between the two allreduces with Open MPI spinning or yielding (train_worker.py
# --impl horovod-blocks): the comparisons made under the same conditions.
HOROVOD_JOBS = (("kvcoll", ["--dense-backend", "kvcoll"]),
                ("horovod", ["--dense-backend", "horovod"]),
                ("blocks", ["--impl", "horovod-blocks"]))
BLOCK_WHAT = {"kvcoll/spin": "kvcoll's allreduce, Open MPI spinning",
              "horovod/spin": "Horovod's allreduce, Open MPI spinning (before this change)",
              "kvcoll/yield": "kvcoll's allreduce, Open MPI yielding when idle",
              "horovod/yield": "Horovod's allreduce, Open MPI yielding when idle (now)"}


def run_horovod(args, rounds: int = 3) -> None:
    """kvcoll on 2 ranks: its own dense allreduce, Horovod's, and the block-alternating
    job (see HOROVOD_JOBS), in interleaved rounds in one run; before each job it waits (up
    to 90 s) for a quiet machine and records what other processes used."""
    steps, batch, evals = (20, 1024, 8192) if args.quick else \
        (args.train_steps, args.train_batch, 50_000)
    block, block_rounds = (5, 2) if args.quick else (25, 6)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for name, flags in HOROVOD_JOBS:
                busy = common.wait_until_quiet(0 if args.quick else 90)
                path = os.path.join(tmp, f"{name}{i}.json")
                print(f"[train] kvcoll on 2 ranks: {name} (round {i + 1}; others busy "
                      f"{busy:.2f} cores)", flush=True)
                _mpirun(2, ["--impl", "kvcoll", "--steps", str(steps), "--batch-size", str(batch),
                            "--eval-samples", str(evals), "--block", str(block), "--rounds",
                            str(block_rounds), *flags, "--out", path], timeout=3600)
                records.append(dict(json.load(open(path)), pair=i, config=name,
                                    others_busy_cores=round(busy, 2)))
    common.publish(args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS),
                   "train-horovod", records, lambda m: markdown_horovod(records, steps, batch, m))


def markdown_horovod(records, steps, batch, machine) -> str:
    jobs = [r for r in records if r["config"] != "blocks"]
    blocks = [r for r in records if r["config"] == "blocks"]

    def median(name, key):
        return statistics.median(key(r) for r in jobs if r["config"] == name)

    what = {"kvcoll": "kvcoll's own (no Horovod in the job)",
            "horovod": "Horovod's (Open MPI yields when idle)"}
    lines = [
        "# kvcoll with Horovod's allreduce for the dense gradients",
        "",
        f"`python -m bench train --horovod` in the Horovod lane (`.venv-tf215`) — DeepFM, 2 "
        f"ranks, one TensorFlow thread per rank, a global batch of {batch}, jobs interleaved "
        f"in rounds; {machine['cpu']}, {machine['cores']} cores, TensorFlow "
        f"{machine.get('tensorflow', '?')}, {machine.get('date', '')}.",
        "",
        f"## Whole jobs ({steps} timed steps each)",
        "",
        "| dense allreduce | round | others busy | samples/s | eval AUC | final loss | ms/step: "
        "exchange / compute / allreduce / apply / total |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in jobs:
        ms = r["ms_per_step"]
        lines.append(f"| {what[r['config']]} | {r['pair'] + 1} | {r['others_busy_cores']:.2f} | "
                     f"{r['samples_per_sec']:,.0f} | {r['eval_auc']:.4f} | "
                     f"{r['final_loss']:.6f} | {ms['exchange']:.1f} / {ms['compute']:.1f} / "
                     f"{ms['allreduce']:.1f} / {ms['apply']:.1f} / {ms['total']:.1f} |")
    names = [n for n in what if any(r["config"] == n for r in jobs)]
    rate = {n: median(n, lambda r: r["samples_per_sec"]) for n in names}
    lines.append("")
    for n in names:
        ratio = "" if n == "kvcoll" else f" ({rate[n] / rate['kvcoll']:.2f}x kvcoll's own)"
        lines.append(f"- {what[n]}: median {rate[n]:,.0f} samples/s{ratio}, allreduce "
                     f"{median(n, lambda r: r['ms_per_step']['allreduce']):.2f} ms a step, "
                     f"compute {median(n, lambda r: r['ms_per_step']['compute']):.1f} ms")
    lines.append("- the same steps on the same batches: the final losses and AUCs agree (the "
                 "dense gradient is the same sum either way)")
    if blocks:
        b0 = blocks[0]
        lines += [
            "",
            f"## One Horovod job, blocks of {b0['block_steps']} steps alternating four settings "
            f"({b0['rounds']} rounds, rotating order, per job)",
            "",
            "Both allreduces with Horovod initialised (its background thread cycles in both), "
            "Open MPI's waits spinning or yielding (switched between blocks on every rank): "
            "each ratio compares blocks run under the same conditions.",
            "",
            "| setting | samples/s per job (median of its blocks) | median over jobs |",
            "|---|---|---|",
        ]
        med = {}
        for key, text in BLOCK_WHAT.items():
            per_job = [r["median_samples_per_sec"][key] for r in blocks]
            med[key] = statistics.median(per_job)
            lines.append(f"| {text} | {', '.join(f'{v:,.0f}' for v in per_job)} | "
                         f"{med[key]:,.0f} |")

        def ratio(a, b):
            per_job = [r["median_samples_per_sec"][a] / r["median_samples_per_sec"][b]
                       for r in blocks]
            return (f"{statistics.median(per_job):.2f}x (per job: "
                    f"{', '.join(f'{x:.2f}' for x in per_job)})")

        lines += [
            "",
            f"- Horovod's allreduce against kvcoll's, Open MPI yielding: "
            f"{ratio('horovod/yield', 'kvcoll/yield')}",
            f"- the same, Open MPI spinning (as before): {ratio('horovod/spin', 'kvcoll/spin')}",
            f"- Horovod's allreduce, yielding against spinning: "
            f"{ratio('horovod/yield', 'horovod/spin')}",
            f"- kvcoll's allreduce next to Horovod's idle background thread, yielding against "
            f"spinning: {ratio('kvcoll/yield', 'kvcoll/spin')}",
        ]
    lines += [
        "",
        "Horovod's background thread runs a blocking collective with every rank every cycle "
        "(HOROVOD_CYCLE_TIME, 1 ms), even when idle (the response cache's bit vector); "
        "spinning in it, a rank whose peer is descheduled takes the core the training step "
        "needs (see the compute time). Yielding, what remains is the cycle's latency.",
        "",
    ]
    return "\n".join(lines)


def file_pairs(steps: int, batch: int, evals: int, pairs: int, wait: float = 300) -> list[dict]:
    """kvcoll on synthetic batches and on the same samples read from a Criteo TSV file,
    in alternating pairs on 1 and 2 ranks. The file holds the warm-up and timed steps'
    samples (line t*B+i is synthetic sample t*B+i, so both runs train on the same
    global batches); the evaluation file holds the synthetic eval samples."""
    from .data_bench import write_criteo

    records = []
    with tempfile.TemporaryDirectory(dir=common.ROOT, prefix="kvbench-train-") as tmp:
        train = os.path.join(tmp, "train.tsv")
        evalf = os.path.join(tmp, "eval.tsv")
        lines = (steps + 10) * batch                     # the worker's 10 warm-up steps
        print(f"[train] writing {lines:,} lines of Criteo TSV", flush=True)
        size = write_criteo(train, lines)
        write_criteo(evalf, evals, stream="eval")
        for world in (1, 2):
            for pair in range(pairs):
                busy = common.wait_until_quiet(wait)  # the machine is shared: a quiet moment
                for data in ("synthetic", "criteo-tsv"):
                    path = os.path.join(tmp, f"{data}{world}-{pair}.json")
                    extra = ["--data", train, "--eval-data", evalf] if data != "synthetic" else []
                    print(f"[train] kvcoll on {data} data, {world} rank(s), pair {pair + 1}",
                          flush=True)
                    _mpirun(world, ["--impl", "kvcoll", "--steps", str(steps), "--batch-size",
                                    str(batch), "--eval-samples", str(evals), "--out", path,
                                    *extra], timeout=3600)
                    records.append(dict(json.load(open(path)), pair=pair, file_bytes=size,
                                        busy_before=busy))
    return records


RANKS_PHASES = ("data", "exchange", "tables", "compute", "allreduce", "apply", "stage_wait",
                "total")
RANKS_VARIANTS = (("off", "unpipelined (kv.Trainer.train)"),
                  ("on", "pipelined (kv.Trainer.train_next, the default)"))


def ranks_rounds(steps: int, batch: int, evals: int, rounds: int, wait: float = 120
                 ) -> list[dict]:
    """kvcoll (the demo configuration: one TensorFlow thread a rank, the loop, BSP) on 1 and
    on 2 ranks with the same global batch, unpipelined and pipelined, in `rounds` rounds;
    the order of the world sizes alternates (1 then 2, then 2 then 1) so that a drift of
    the machine falls on both alike. Before each launch the bench waits (up to `wait`
    seconds) for other processes to use less than 0.3 CPUs, and records what they used."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            for world in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                for prefetch, _ in RANKS_VARIANTS:
                    busy = common.wait_until_quiet(wait)
                    path = os.path.join(tmp, f"kvcoll{world}-{prefetch}-{rnd}.json")
                    print(f"[train] kvcoll on {world} rank(s), pipeline {prefetch}, round "
                          f"{rnd + 1} of {rounds}", flush=True)
                    _mpirun(world, ["--impl", "kvcoll", "--steps", str(steps), "--batch-size",
                                    str(batch), "--eval-samples", str(evals), "--prefetch",
                                    prefetch, "--out", path], timeout=3600)
                    records.append(dict(json.load(open(path)), round=rnd, busy_before=busy,
                                        prefetch=prefetch))
    return records


def ranks_summary(records) -> dict:
    """Per variant (pipeline off / on): each round's 2-rank samples/s over its 1-rank ones,
    their median, and each phase's median ms a step on 1 and on 2 ranks."""
    import statistics

    out = {}
    for prefetch, _ in RANKS_VARIANTS:
        by = {(r["round"], r["world_size"]): r for r in records
              if r.get("prefetch", "off") == prefetch}
        rounds = sorted({i for i, _ in by})
        if not rounds:
            continue
        ratios = [by[(i, 2)]["samples_per_sec"] / by[(i, 1)]["samples_per_sec"] for i in rounds]
        phases = {w: {k: statistics.median(by[(i, w)]["ms_per_step"].get(k, 0.0)
                                           for i in rounds) for k in RANKS_PHASES}
                  for w in (1, 2)}
        out[prefetch] = {
            "rounds": rounds, "ratios": ratios, "ratio": statistics.median(ratios),
            "samples_per_sec": {w: statistics.median(by[(i, w)]["samples_per_sec"]
                                                     for i in rounds) for w in (1, 2)},
            "per_round": [(by[(i, 1)], by[(i, 2)]) for i in rounds], "phases_ms": phases}
    return out


def ranks_markdown(records, steps, batch, machine) -> str:
    summ = ranks_summary(records)
    rounds = len({r["round"] for r in records})
    lines = [
        "# kvcoll on 1 rank and on 2 ranks: the 1 -> 2 ranks ratio in rounds",
        "",
        f"`./dev bench train` (this part alone: `--train-ranks-only`): kvcoll's demo "
        f"configuration (DeepFM, the kv.Trainer loop, BSP, one TensorFlow thread a rank), "
        f"{steps} timed steps of a global batch of {batch} (on 2 ranks, {batch // 2} a rank), "
        f"on 1 rank and on 2, unpipelined and pipelined, in {rounds} rounds whose order of "
        f"world sizes alternates (1 then 2, then 2 then 1). Before each launch the bench "
        f"waited (up to 2 minutes) for other processes to use less than 0.3 CPUs: they used "
        f"{max(r['busy_before'] for r in records):.2f} at most. {machine['cpu']}, "
        f"{machine['cores']} cores, {machine.get('date', '')}.",
        "",
        "| round | steps | 1 rank samples/s | 2 ranks samples/s | 2 ranks / 1 rank | "
        "others' CPU before (1 / 2 ranks) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    names = dict(RANKS_VARIANTS)
    for prefetch, s in summ.items():
        for i, (ratio, (a, b)) in enumerate(zip(s["ratios"], s["per_round"])):
            lines.append(f"| {i + 1} | {names[prefetch]} | {a['samples_per_sec']:,.0f} | "
                         f"{b['samples_per_sec']:,.0f} | {ratio:.2f}x | "
                         f"{a['busy_before']:.2f} / {b['busy_before']:.2f} |")
    lines.append("")
    for prefetch, s in summ.items():
        ok = "met" if s["ratio"] >= 1.8 else "**not met**"
        lines.append(
            f"- {names[prefetch]}: **1 -> 2 ranks {s['ratio']:.2f}x** (the median of the "
            f"rounds' ratios, {min(s['ratios']):.2f}-{max(s['ratios']):.2f}x; target >= "
            f"1.8x: {ok}). Medians: {s['samples_per_sec'][1]:,.0f} samples/s on 1 rank, "
            f"{s['samples_per_sec'][2]:,.0f} on 2.")
    labels = {"data": "data (making the batch)", "exchange": "exchange (pull and push)",
              "tables": "of it, in the tables' C calls", "compute": "compute (TensorFlow)",
              "allreduce": "dense allreduce", "apply": "dense apply",
              "stage_wait": "waiting for the next batch's stage", "total": "the step"}
    for prefetch, s in summ.items():
        ph = s["phases_ms"]
        lines += [
            "", f"Where a step goes, {names[prefetch]} (ms a step, rank 0, the median over "
            "the rounds). On 2 ranks each rank has half the batch, so a phase that scaled "
            "perfectly would take half its 1-rank time:", "",
            "| phase | 1 rank | 2 ranks | 2 ranks / (1 rank / 2) |", "|---|---:|---:|---:|"]
        for k in RANKS_PHASES:
            one, two = ph[1][k], ph[2][k]
            rel = f"{two / (one / 2):.2f}" if one > 0.05 else "-"
            lines.append(f"| {labels[k]} | {one:.1f} | {two:.1f} | {rel} |")
    return "\n".join(lines) + "\n"


def file_summary(records) -> dict:
    """Per world size: the file run's samples/s over its synthetic partner's, per pair,
    and the median of those ratios."""
    import statistics

    out = {}
    for world in sorted({r["world_size"] for r in records}):
        syn = {r["pair"]: r for r in records if r["world_size"] == world
               and r["data"] == "synthetic"}
        fil = {r["pair"]: r for r in records if r["world_size"] == world
               and r["data"] == "criteo-tsv"}
        ratios = [fil[p]["samples_per_sec"] / syn[p]["samples_per_sec"] for p in fil if p in syn]
        out[world] = {"ratios": ratios, "ratio": statistics.median(ratios),
                      "synthetic": statistics.median(r["samples_per_sec"] for r in syn.values()),
                      "file": statistics.median(r["samples_per_sec"] for r in fil.values()),
                      "data_ms": {k: statistics.median(r["ms_per_step"]["data"] for r in v.values())
                                  for k, v in (("synthetic", syn), ("file", fil))},
                      "total_ms": {k: statistics.median(r["ms_per_step"]["total"]
                                                        for r in v.values())
                                   for k, v in (("synthetic", syn), ("file", fil))},
                      "auc": {k: statistics.median(r["eval_auc"] for r in v.values())
                              for k, v in (("synthetic", syn), ("file", fil))}}
    return out


def file_markdown(records, steps, batch, machine) -> str:
    s = file_summary(records)
    size = records[0]["file_bytes"]
    lines = [
        "# Training from a Criteo TSV file vs synthetic batches",
        "",
        f"`./dev bench train` (file part: `--train-file-only`) — the demo configuration "
        f"(DeepFM, kv.Trainer loop, BSP, one TensorFlow thread per rank), {steps} timed steps of "
        f"a global batch of {batch}: generated by SyntheticCTR, or the same samples read from "
        f"a {size / 1e6:.0f} MB Criteo TSV file by kvcoll.data.read_criteo (split='global', "
        f"read ahead by a background thread). Runs alternate synthetic, file, synthetic, ...; "
        f"before each pair the bench waits (up to 5 minutes) until other processes use less "
        f"than 0.3 CPUs: they used {max(r['busy_before'] for r in records):.2f} at most. "
        f"{machine['cpu']}, {machine['cores']} cores, {machine.get('date', '')}.",
        "",
        "| ranks | synthetic samples/s | file samples/s | file / synthetic (median) | pairs | "
        "data ms/step (synthetic / file) | step ms (synthetic / file) | eval AUC "
        "(synthetic / file) | target >= 95% |",
        "|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for world, d in s.items():
        pairs = ", ".join(f"{r:.1%}" for r in d["ratios"])
        ok = "met" if d["ratio"] >= 0.95 else "**not met**"
        lines.append(f"| {world} | {d['synthetic']:,.0f} | {d['file']:,.0f} | {d['ratio']:.1%} | "
                     f"{pairs} | {d['data_ms']['synthetic']:.2f} / {d['data_ms']['file']:.2f} | "
                     f"{d['total_ms']['synthetic']:.1f} / {d['total_ms']['file']:.1f} | "
                     f"{d['auc']['synthetic']:.4f} / {d['auc']['file']:.4f} | {ok} |")
    lines += [
        "",
        "- data ms/step: for the file, the time the step loop waited for the next batch "
        "(the reading thread works meanwhile, on the same cores); for synthetic data, "
        "generating the batch",
        "- the file's numeric values are integers (round(expm1(x)), 10% missing, as in Criteo) "
        "read back as sign * log1p, and its ids criteo_id's: the same samples, the same "
        "number of distinct ids per step, slightly different numbers (hence the AUCs)",
    ]
    return "\n".join(lines) + "\n"


def _get(records, impl, world, variant=None):
    return next(r for r in records if r["impl"] == impl and r["world_size"] == world
                and r.get("variant") == variant)


def summary(records) -> dict:
    """The ratios the issue names, from one run's records."""
    wide = [r for r in records if r.get("variant")]
    records = [r for r in records if not r.get("variant")]
    kv1, kv2 = _get(records, "kvcoll", 1), _get(records, "kvcoll", 2)
    bl1, bl2 = _get(records, "baseline", 1), _get(records, "baseline", 2)
    bg1, bg2 = _get(records, "baseline-gather", 1), _get(records, "baseline-gather", 2)
    limits = {(r["world_size"], r["global_batch_size"] // r["world_size"]): r["samples_per_sec"]
              / r["world_size"] for r in records if r["impl"] == "limit"}
    b = kv1["global_batch_size"]
    ex = {r["world_size"]: r["ms_per_step"]["total"] for r in records if r["impl"] == "exchange"}
    lim_ms = {(r["world_size"], r["global_batch_size"] // r["world_size"]): r["ms_per_step"]["total"]
              for r in records if r["impl"] == "limit"}
    def new_memory_ms(r):  # of a step: first touch of the pages the new rows land in
        gbps = r.get("first_touch_gbps")
        return r["new_rows_mb_per_step"] / gbps if gbps else None

    def without_new_memory(r, limit_per_rank):  # per rank, vs the limit, without that
        ms = r["ms_per_step"]["total"] - new_memory_ms(r)
        return r["global_batch_size"] / r["world_size"] / (ms / 1e3) / limit_per_rank

    touch = "first_touch_gbps" in kv1 and "first_touch_gbps" in kv2
    return {
        "new_memory_ms_1": new_memory_ms(kv1) if touch else None,
        "new_memory_ms_2": new_memory_ms(kv2) if touch else None,
        "kvcoll_1_vs_limit_without_new_memory": (
            without_new_memory(kv1, limits[(1, b)]) if touch else None),
        "kvcoll_2_per_rank_vs_limit_without_new_memory": (
            without_new_memory(kv2, limits[(1, b // 2)]) if touch else None),
        "kvcoll_2_per_rank_vs_limit_2procs_without_new_memory": (
            without_new_memory(kv2, limits[(2, b // 2)]) if touch else None),
        # the most kvcoll could reach if nothing but the dense step and the sparse side
        # (exchange alone) took time: limit / (limit + exchange)
        "bound_1": lim_ms[(1, b)] / (lim_ms[(1, b)] + ex[1]) if 1 in ex else None,
        "bound_2": lim_ms[(1, b // 2)] / (lim_ms[(1, b // 2)] + ex[2]) if 2 in ex else None,
        "kvcoll_vs_baseline_1": kv1["samples_per_sec"] / bl1["samples_per_sec"],
        "kvcoll_vs_baseline_2": kv2["samples_per_sec"] / bl2["samples_per_sec"],
        "kvcoll_vs_gather_1": kv1["samples_per_sec"] / bg1["samples_per_sec"],
        "kvcoll_vs_gather_2": kv2["samples_per_sec"] / bg2["samples_per_sec"],
        "kvcoll_scaling_1_to_2": kv2["samples_per_sec"] / kv1["samples_per_sec"],
        "gather_scaling_1_to_2": bg2["samples_per_sec"] / bg1["samples_per_sec"],
        "baseline_scaling_1_to_2": bl2["samples_per_sec"] / bl1["samples_per_sec"],
        "kvcoll_1_vs_limit": kv1["samples_per_sec"] / limits[(1, b)],
        "kvcoll_2_per_rank_vs_limit": kv2["samples_per_sec"] / 2 / limits[(1, b // 2)],
        "kvcoll_2_per_rank_vs_limit_2procs": kv2["samples_per_sec"] / 2 / limits[(2, b // 2)],
        "wide_variant": wide[0]["variant"] if wide else None,
        # kvcoll on 2 ranks vs two processes of the limit at once, with the wide MLP
        "wide_kvcoll_2_per_rank_vs_limit_2procs": (
            _get(wide, "kvcoll", 2, wide[0]["variant"])["samples_per_sec"]
            / _get(wide, "limit", 2, wide[0]["variant"])["samples_per_sec"]) if wide else None,
    }


def markdown(records, steps, batch, machine) -> str:
    lines = [
        "# Training throughput (DeepFM, synthetic CTR data)",
        "",
        f"`./dev bench train` — {steps} timed steps, global batch {batch}, one TensorFlow "
        f"thread per rank; {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['memory_gib']} GiB, TensorFlow {machine.get('tensorflow', '?')}, "
        f"{machine.get('date', '')}.",
        "",
        "| impl | ranks | batch (per rank) | samples/s | eval AUC | ms/step: data / exchange (C tables) / compute / allreduce / apply / total |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        world = r["world_size"]
        per_rank = r["global_batch_size"] // world
        ms = r.get("ms_per_step") or {}
        if r["impl"] == "exchange":
            lines.append(f"| exchange alone | {world} | {per_rank} |  |  | {ms['total']:.1f} total "
                         f"({ms['tables']:.1f} in the tables), no TensorFlow step |")
            continue
        split = (f"{ms['data']:.1f} / {ms['exchange']:.1f} ({ms['tables']:.1f}) / "
                 f"{ms['compute']:.1f} / {ms['allreduce']:.1f} / {ms['apply']:.1f} / "
                 f"{ms['total']:.1f}") if "exchange" in ms else \
            f"{ms.get('total', 1e3 * r['global_batch_size'] / r['samples_per_sec']):.1f} total"
        if r["impl"] == "limit" and world > 1:
            split += f" (each of {world} processes at once)"
        auc = "" if r.get("eval_auc") is None else f"{r['eval_auc']:.4f}"
        impl = r["impl"] + (f" ({r['variant']})" if r.get("variant") else "")
        lines.append(f"| {impl} | {world} | {per_rank} | {r['samples_per_sec']:,.0f} | "
                     f"{auc} | {split} |")
    s = summary(records)
    kv1, kv2 = _get(records, "kvcoll", 1), _get(records, "kvcoll", 2)
    planted = kv1.get("planted_auc")
    lines += [
        "",
        f"- kvcoll / baseline: {s['kvcoll_vs_baseline_1']:.2f}x on 1 rank, "
        f"{s['kvcoll_vs_baseline_2']:.2f}x on 2 ranks (target >= 1 at equal AUC; planted "
        f"AUC {planted:.4f})",
        f"- kvcoll / baseline-gather: {s['kvcoll_vs_gather_1']:.2f}x on 1 rank, "
        f"{s['kvcoll_vs_gather_2']:.2f}x on 2 ranks",
        f"- 1 -> 2 ranks: kvcoll {s['kvcoll_scaling_1_to_2']:.2f}x, baseline "
        f"{s['baseline_scaling_1_to_2']:.2f}x, baseline-gather "
        f"{s['gather_scaling_1_to_2']:.2f}x (target >= 1.7x for kvcoll)",
        f"- kvcoll per rank vs the dense-step limit: {s['kvcoll_1_vs_limit']:.0%} on 1 rank, "
        f"{s['kvcoll_2_per_rank_vs_limit']:.0%} on 2 ranks (target >= 75%); on 2 ranks vs "
        f"the limit of two processes running at once: "
        f"{s['kvcoll_2_per_rank_vs_limit_2procs']:.0%}",
        f"- with the {s['wide_variant']} (the DeepFM paper's), kvcoll per rank on 2 ranks vs "
        f"the limit of two processes at once: "
        f"{s['wide_kvcoll_2_per_rank_vs_limit_2procs']:.0%} (the sparse side's cost per step "
        f"is the same; the dense step is heavier)" if s["wide_variant"] else "",
        f"- exchange alone (the same batches' pulls and pushes, kvcoll's tables and MPI, no "
        f"TensorFlow step): with nothing else taking time, a step would be the limit plus "
        f"that, so kvcoll can reach at most {s['bound_1']:.0%} of the limit on 1 rank and "
        f"{s['bound_2']:.0%} on 2 ranks on this machine" if s["bound_1"] else "",
        (f"- new rows: kvcoll's shards grew by {kv1['new_rows_mb_per_step']:.2f} MB per step "
         f"on 1 rank and {kv2['new_rows_mb_per_step']:.2f} MB per rank on 2 ranks. This "
         f"machine gives a process new memory at {kv1['first_touch_gbps']:.2f} / "
         f"{kv2['first_touch_gbps']:.2f} GB/s (first write to each page of a fresh 256 MiB "
         f"mapping with huge pages, measured after each run; reused memory is written "
         f"far faster), so about {s['new_memory_ms_1']:.1f} / {s['new_memory_ms_2']:.1f} ms of "
         f"a step is the kernel and the VM's host supplying the pages the new rows land in "
         f"(inside \"C tables\"). Without that cost kvcoll per rank would be at "
         f"{s['kvcoll_1_vs_limit_without_new_memory']:.0%} of the limit on 1 rank, "
         f"{s['kvcoll_2_per_rank_vs_limit_without_new_memory']:.0%} on 2 ranks, "
         f"{s['kvcoll_2_per_rank_vs_limit_2procs_without_new_memory']:.0%} vs two processes "
         f"at once") if s["new_memory_ms_1"] is not None else "",
        "- ms/step columns: data = generating the batch (SyntheticCTR); exchange = pull and "
        "push, of which (C tables) = time inside the table's C calls (lookup, create, "
        "update), the rest being MPI and Python glue; compute = the compiled TensorFlow "
        "step with its inputs and outputs; allreduce = the fused dense allreduce; apply = "
        "the Keras optimizer on the dense weights",
        "",
    ]
    return "\n".join(lines)


def chart(records, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ["kvcoll", "baseline", "baseline-gather"]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    width = 0.35
    for i, world in enumerate((1, 2)):
        vals = [_get(records, impl, world)["samples_per_sec"] for impl in impls]
        xs = [j + (i - 0.5) * width for j in range(len(impls))]
        bars = ax.bar(xs, vals, width, label=f"{world} rank{'s' if world > 1 else ''}")
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in vals], fontsize=8)
    limit = max((r for r in records if r["impl"] == "limit" and r["world_size"] == 1),
                key=lambda r: r["global_batch_size"])
    ax.axhline(limit["samples_per_sec"], color="grey", ls="--", lw=1,
               label="dense-step limit (1 rank)")
    ax.set_xticks(range(len(impls)), ["kvcoll", "keras Embedding\n+ allgather",
                                      "ResourceGather\n+ allgather"])
    ax.set_ylabel("samples / s")
    ax.set_title("DeepFM training throughput, one thread per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
