"""Step modes with and without a straggler: BSP, SSP (S = 1, 4) and ASP on 2 ranks.

    python -m bench async            # full: several minutes
    python -m bench async --quick    # a smoke test

In one run, examples/train.py (DeepFM, synthetic data, the demo's hyperparameters)
trains the same number of steps per rank (so the same samples) in each mode:

- without a straggler: BSP, SSP(1), SSP(4), ASP;
- with rank 1 slowed by --slow-ms per step (default: one normal BSP step, measured
  in the first run): the same four.

Throughput is the sum of every rank's own rate (samples it trained / its own training
time); for BSP that is the global rate. The ideal with a straggler is the sum of each
rank's unimpeded rate: rank r's step time in the straggler-free ASP run (where nobody
waits), plus the sleep for the slowed rank. On a machine where the ranks share cores,
a sleeping straggler leaves its core to the others, so the fast rank can beat its
straggler-free rate and a mode can exceed 100% of this ideal. Every run ends with the
evaluation AUC on the same held-out samples. Each run waits (up to 5 minutes) for the
machine to be quiet and records how busy it was.

Writes bench/results/async.json and async.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from . import common

TRAIN = os.path.join(common.ROOT, "examples", "train.py")
MODES = [("bsp", []), ("ssp1", ["--step-mode", "ssp", "--staleness", "1"]),
         ("ssp4", ["--step-mode", "ssp", "--staleness", "4"]), ("asp", ["--step-mode", "asp"])]


def add_arguments(p) -> None:
    g = p.add_argument_group("async")
    g.add_argument("--async-steps", type=int, default=300, help="steps per rank and run")
    g.add_argument("--async-batch", type=int, default=4096, help="global batch")
    g.add_argument("--slow-ms", type=float, default=None,
                   help="rank 1's extra sleep per step (default: one measured BSP step)")


def _train(args: list[str], out: str, timeout: float) -> dict:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable, TRAIN,
           "--no-progress", "--log-every", "100000", "--metrics-out", out, *args]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=common.ROOT)
    env.pop("KVCOLL_STEP_MODE", None)
    env.pop("KVCOLL_STALENESS", None)
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True,
                          cwd=common.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def run(args) -> None:
    steps = 30 if args.quick else args.async_steps
    batch = 1024 if args.quick else args.async_batch
    evals = 8192 if args.quick else 50_000
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    base = ["--steps", str(steps), "--batch-size", str(batch), "--eval-samples", str(evals)]
    records = []
    slow_ms = args.slow_ms
    with tempfile.TemporaryDirectory() as tmp:
        for straggler in (False, True):
            for name, flags in MODES:
                extra = ["--slow-rank", "1", "--slow-ms", f"{slow_ms:g}"] if straggler else []
                note = f" with rank 1 slowed by {slow_ms:g} ms" if straggler else ""
                busy = common.wait_until_quiet(0 if args.quick else 300, below=0.5)
                print(f"[async] {name}{note} (other processes busy: {busy:.1f} cores)",
                      flush=True)
                m = _train(base + flags + extra, os.path.join(tmp, f"{name}{straggler}.json"),
                           timeout=3600)
                rec = {k: m.get(k) for k in (
                    "step_mode", "staleness", "world_size", "global_batch_size", "steps",
                    "local_steps", "samples_per_sec", "steps_per_sec", "max_staleness_observed",
                    "max_clock_lead", "eval_auc", "planted_auc", "eval_samples",
                    "timings_ms_per_step", "train_seconds")}
                rec.update(mode=name, straggler=straggler, slow_ms=slow_ms if straggler else 0.0,
                           busy_cores_before=busy)
                records.append(rec)
                if slow_ms is None:  # about one normal step, from the first (BSP) run
                    slow_ms = round(m["timings_ms_per_step"]["total"])
    _annotate(records, batch)
    common.publish(out_dir, "async", records, lambda m: markdown(records, steps, batch, m))


def _get(records, mode, straggler):
    return next(r for r in records if r["mode"] == mode and r["straggler"] == straggler)


def _annotate(records, batch) -> None:
    """The ideal straggler throughput and each run's ratios to it and to BSP."""
    free = _get(records, "asp", False)
    per_rank = [batch // 2, batch - batch // 2]
    step_s = [1.0 / s for s in free["steps_per_sec"]]
    for r in records:
        bsp = _get(records, "bsp", r["straggler"])
        r["vs_bsp_samples_per_sec"] = r["samples_per_sec"] / bsp["samples_per_sec"]
        r["auc_minus_bsp"] = r["eval_auc"] - bsp["eval_auc"]
        if r["straggler"]:
            extra = [0.0, r["slow_ms"] / 1e3]
            r["ideal_samples_per_sec"] = sum(b / (s + e)
                                             for b, s, e in zip(per_rank, step_s, extra))
            r["vs_ideal"] = r["samples_per_sec"] / r["ideal_samples_per_sec"]


def markdown(records, steps, batch, machine) -> str:
    slow = next(r["slow_ms"] for r in records if r["straggler"])
    lines = [
        "# Step modes with and without a straggler (DeepFM, synthetic CTR data, 2 ranks)",
        "",
        f"`./dev bench async` — {steps} steps per rank, global batch {batch}, straggler: rank 1 "
        f"sleeps {slow:g} ms per step (about one normal step); {machine['cpu']}, "
        f"{machine['cores']} cores, {machine.get('date', '')}. Throughput: the sum of every "
        "rank's own rate; ideal: each rank's unimpeded rate (its step time in the "
        "straggler-free ASP run, plus the sleep), summed; above 100% when the sleeping "
        "straggler leaves its core to the fast rank.",
        "",
        "| straggler | mode | samples/s | vs BSP | vs ideal | steps/s per rank | "
        "max staleness | eval AUC | AUC - BSP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ideal = f"{r['vs_ideal']:.0%}" if "vs_ideal" in r else ""
        sps = " / ".join(f"{x:.1f}" for x in r["steps_per_sec"])
        lines.append(
            f"| {'yes' if r['straggler'] else 'no'} | {r['mode']} | {r['samples_per_sec']:,.0f} | "
            f"{r['vs_bsp_samples_per_sec']:.2f}x | {ideal} | {sps} | "
            f"{r['max_staleness_observed']} | {r['eval_auc']:.4f} | {r['auc_minus_bsp']:+.4f} |")
    asp = _get(records, "asp", True)
    worst_free = min(_get(records, m, False)["vs_bsp_samples_per_sec"]
                     for m in ("ssp1", "ssp4", "asp"))
    lines += [
        "",
        f"- with the straggler, ASP reaches {asp['vs_ideal']:.0%} of the ideal throughput "
        f"(target >= 90%) at {asp['auc_minus_bsp']:+.4f} AUC from BSP (target within 0.01); "
        f"SSP(1) {_get(records, 'ssp1', True)['vs_ideal']:.0%}, SSP(4) "
        f"{_get(records, 'ssp4', True)['vs_ideal']:.0%}, BSP "
        f"{_get(records, 'bsp', True)['vs_ideal']:.0%}",
        f"- without a straggler, the slowest of SSP/ASP runs at {worst_free:.2f}x BSP "
        "(target >= 0.90x)",
        "",
    ]
    return "\n".join(lines)
