"""Feature lifecycle: training throughput with admission + eviction on vs off.

Runs examples/train.py (DeepFM, synthetic data, 26 tables) on 2 ranks, alternating
runs without and with `--admit-min-count 2 --evict-after-steps T --max-rows-per-table R
--evict-every N`, and reports samples/s of each (best of the repetitions), the
throughput cost, the longest eviction pause on any rank and its ratio to a normal
step. Targets: cost <= 5 %, longest pause <= one step.

Writes bench/results/lifecycle.json and lifecycle.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from . import common

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "examples", "train.py")


def add_arguments(p) -> None:
    g = p.add_argument_group("lifecycle")
    g.add_argument("--lifecycle-steps", type=int, default=200, help="steps per run")
    g.add_argument("--lifecycle-reps", type=int, default=2, help="runs of each setting")
    g.add_argument("--lifecycle-world", type=int, default=2, help="ranks")
    g.add_argument("--admit-min-count", type=int, default=2)
    g.add_argument("--evict-after-steps", type=int, default=100)
    g.add_argument("--max-rows-per-table", type=int, default=40_000)
    g.add_argument("--evict-every", type=int, default=50)


def _train(world: int, flags: list[str], path: str) -> dict:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(world), sys.executable,
           TRAIN, "--no-progress", "--metrics-out", path, *flags]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, env=env, timeout=3600, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)


def run(args) -> None:
    steps = 40 if args.quick else args.lifecycle_steps
    reps = 1 if args.quick else args.lifecycle_reps
    world = args.lifecycle_world
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    base = ["--steps", str(steps), "--eval-samples", "8192", "--log-every", str(10 * steps)]
    life = ["--admit-min-count", str(args.admit_min_count),
            "--evict-after-steps", str(args.evict_after_steps),
            "--max-rows-per-table", str(args.max_rows_per_table),
            "--evict-every", str(args.evict_every)]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for setting, flags in (("off", base), ("on", base + life)):
                print(f"[lifecycle] {setting}, run {rep + 1}/{reps}: {steps} steps on "
                      f"{world} ranks", flush=True)
                m = _train(world, flags, os.path.join(tmp, f"{setting}{rep}.json"))
                m.pop("loss_curve", None)
                records.append({"setting": setting, "rep": rep, **m})
    machine = common.machine_info()
    for r in records:
        r["machine"] = machine
    s = summary(records)
    records.append({"summary": s})
    jpath, mpath = common.write_results(out_dir, "lifecycle", records,
                                        markdown(records[:-1], s, steps, world, args, machine))
    print(json.dumps(s, indent=1))
    print(f"wrote {jpath} and {mpath}")


def summary(records) -> dict:
    off = [r for r in records if r["setting"] == "off"]
    on = [r for r in records if r["setting"] == "on"]
    best_off = max(r["samples_per_sec"] for r in off)
    best_on = max(r["samples_per_sec"] for r in on)
    step_ms = min(r["timings_ms_per_step"]["total"] for r in off)
    pause = max(r["max_evict_pause_ms"] for r in on)
    return {"samples_per_sec_off": best_off, "samples_per_sec_on": best_on,
            "throughput_cost": 1.0 - best_on / best_off,
            "step_ms_off": step_ms, "max_evict_pause_ms": pause,
            "pause_over_step": pause / step_ms,
            "mean_evict_pause_ms": max(r["mean_evict_pause_ms"] for r in on),
            "rows_off": max(r["table_rows"] for r in off),
            "rows_on": max(r["table_rows"] for r in on),
            "bytes_off": max(r["table_bytes"] for r in off),
            "bytes_on": max(r["table_bytes"] for r in on),
            "eval_auc_off": max(r["eval_auc"] for r in off),
            "eval_auc_on": max(r["eval_auc"] for r in on),
            "within_budget": all(r["within_budget"] for r in on)}


def markdown(records, s, steps, world, args, machine) -> str:
    lines = [
        "# Feature lifecycle: admission + eviction on vs off", "",
        f"DeepFM on synthetic data (26 tables, Zipf ids over 10^7 per field), {world} ranks, "
        f"{steps} steps of a 4096 global batch, best of {args.lifecycle_reps} alternating "
        f"runs per setting. On: `--admit-min-count {args.admit_min_count} --evict-after-steps "
        f"{args.evict_after_steps} --max-rows-per-table {args.max_rows_per_table} "
        f"--evict-every {args.evict_every}` (exact admission counting, LRU budget).", "",
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores.", "",
        "| setting | samples/s | ms/step | table rows | table MiB | eval AUC | longest eviction "
        "pause (ms) | mean pause (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['setting']} (run {r['rep'] + 1}) | {r['samples_per_sec']:,.0f} | "
            f"{r['timings_ms_per_step']['total']:.1f} | {r['table_rows']:,} | "
            f"{r['table_bytes'] / 2**20:,.0f} | {r['eval_auc']:.4f} | "
            f"{r.get('max_evict_pause_ms', 0):.1f} | {r.get('mean_evict_pause_ms', 0):.1f} |")
    lines += [
        "",
        f"- throughput cost: {100 * s['throughput_cost']:.1f} % (target <= 5 %)",
        f"- longest eviction pause: {s['max_evict_pause_ms']:.1f} ms = "
        f"{s['pause_over_step']:.2f} of a normal step ({s['step_ms_off']:.1f} ms; target <= 1)",
        f"- every table within its budget at the end: {s['within_budget']}",
        "",
        "A pause is one `Trainer.evict(tables=due)` inside training: examples/train.py "
        "staggers the tables, evicting each once every --evict-every steps (at most one "
        "or two tables in a step), one C call each under the table's write lock. Admission also makes the tables smaller (rows_on vs "
        "rows_off), which is part of why the cost can be negative.", ""]
    return "\n".join(lines)
