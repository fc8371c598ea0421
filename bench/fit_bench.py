"""model.fit against the hand-written step loop: what Keras' fit costs on top of kvcoll.

    python -m bench fit            # 1 and 2 ranks, 3 pairs each: a few minutes
    python -m bench fit --quick    # a smoke test

The DeepFM demo (examples/models.py, the batch and hyperparameters of
examples/train.py) on the same synthetic batches, BSP, one TensorFlow thread per
rank, trained through kv.Trainer's loop (bench/train_worker.py --impl kvcoll) and
through model.fit (--impl fit: a generator of the same batches, Keras' fit loop with
its callbacks). The two run in pairs, loop then fit, on 1 and 2 ranks, so a busy
machine slows both of a pair alike; the result is the ratio of the median samples/s
(target: fit at least 97% of the loop).

Writes bench/results/fit.json and fit.md.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

from . import common
from .train_bench import _mpirun

TARGET = 0.97


def add_arguments(p) -> None:
    g = p.add_argument_group("fit")
    g.add_argument("--fit-steps", type=int, default=300, help="timed steps per run")
    g.add_argument("--fit-batch", type=int, default=4096, help="global batch")
    g.add_argument("--fit-pairs", type=int, default=3, help="loop/fit pairs per world size")


def run(args) -> None:
    steps = 20 if args.quick else args.fit_steps
    batch = 1024 if args.quick else args.fit_batch
    pairs = 1 if args.quick else args.fit_pairs
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            for rep in range(pairs):
                for impl in ("kvcoll", "fit"):
                    path = os.path.join(tmp, f"{impl}{world}-{rep}.json")
                    print(f"[fit] {impl} on {world} rank(s), pair {rep + 1}/{pairs}", flush=True)
                    _mpirun(world, ["--impl", impl, "--steps", str(steps), "--batch-size",
                                    str(batch), "--eval-samples", "20000", "--out", path],
                            timeout=3600)
                    records.append(dict(json.load(open(path)), pair=rep))
    common.publish(out_dir, "fit", records, lambda m: markdown(records, steps, batch, m))


def summary(records) -> dict:
    """Per world size: median samples/s of the loop and of fit, their ratio, the range."""
    out = {}
    for world in sorted({r["world_size"] for r in records}):
        loop = [r["samples_per_sec"] for r in records
                if r["impl"] == "kvcoll" and r["world_size"] == world]
        fit = [r["samples_per_sec"] for r in records
               if r["impl"] == "fit" and r["world_size"] == world]
        pairs = [f / lo for lo, f in zip(loop, fit)]
        out[world] = {"loop": statistics.median(loop), "fit": statistics.median(fit),
                      "ratio": statistics.median(fit) / statistics.median(loop),
                      "pair_ratios": pairs}
    return out


def markdown(records, steps, batch, machine) -> str:
    s = summary(records)
    lines = [
        "# model.fit vs the hand-written loop",
        "",
        f"DeepFM demo, global batch {batch}, {steps} timed steps per run, BSP, one "
        f"TensorFlow thread per rank; loop and fit run in pairs (loop first). Machine: "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores.",
        "",
        "| ranks | loop samples/s (median) | fit samples/s (median) | fit / loop | "
        "pairs (fit / loop) | target >= 97% |",
        "|---|---|---|---|---|---|",
    ]
    for world, d in s.items():
        ok = "met" if d["ratio"] >= TARGET else "NOT met"
        pairs = ", ".join(f"{p:.1%}" for p in d["pair_ratios"])
        lines.append(f"| {world} | {d['loop']:,.0f} | {d['fit']:,.0f} | {d['ratio']:.1%} | "
                     f"{pairs} | {ok} |")
    aucs = {r["impl"]: r["eval_auc"] for r in records if r["world_size"] == max(s)}
    lines += ["", f"Eval AUC after the run ({max(s)} ranks): loop {aucs.get('kvcoll', 0):.4f}, "
              f"fit {aucs.get('fit', 0):.4f} (the same steps on the same batches)."]
    return "\n".join(lines) + "\n"
