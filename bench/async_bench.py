"""Step modes without and with delays: BSP, SSP (S = 1, 4) and ASP on 2 ranks.

    python -m bench async            # full: several minutes
    python -m bench async --quick    # a smoke test

In one run, examples/train.py (DeepFM, synthetic data, the demo's hyperparameters)
trains the same number of steps per rank (so the same samples) in each mode:

- without a straggler: BSP, SSP(1), SSP(4), ASP, --async-rounds times, the modes'
  order rotated each round (each ratio to BSP is taken within a round; the table
  shows the median round's);
- with rank 1 slowed by --slow-ms per step (default: one normal BSP step, measured
  in the first run): the same four;
- with transient delays on every rank (--jitter-ms, default a third of a normal
  step): before each step every rank sleeps a random time, exponential with that
  mean, from a generator seeded per rank (train.py --jitter-ms): the same four.

Throughput is the sum of every rank's own rate (samples it trained / its own training
time); for BSP that is the global rate. The ideal with a straggler is the sum of each
rank's unimpeded rate: rank r's step time in the straggler-free ASP run (where nobody
waits), plus the sleep for the slowed rank. On a machine where the ranks share cores,
a sleeping straggler leaves its core to the others, so the fast rank can beat its
straggler-free rate and a mode can exceed 100% of this ideal. Every run ends with the
evaluation AUC on the same held-out samples. Each run waits (up to --async-quiet-wait
seconds) for the machine to be quiet and records how busy it was before, and how many
CPUs other processes used during the run (the machine's busy time less this run's
own processes', over its wall time); a run during which they used more than 0.3 CPUs
is run again (--async-retries times at most; the least disturbed attempt is kept).

Writes bench/results/async.json and async.md.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from . import common

TRAIN = os.path.join(common.ROOT, "examples", "train.py")
MODES = [("bsp", []), ("ssp1", ["--step-mode", "ssp", "--staleness", "1"]),
         ("ssp4", ["--step-mode", "ssp", "--staleness", "4"]), ("asp", ["--step-mode", "asp"])]


NAMES = {"bsp": "BSP", "ssp1": "SSP(1)", "ssp4": "SSP(4)", "asp": "ASP"}


def add_arguments(p) -> None:
    g = p.add_argument_group("async")
    g.add_argument("--async-steps", type=int, default=300, help="steps per rank and run")
    g.add_argument("--async-batch", type=int, default=4096, help="global batch")
    g.add_argument("--slow-ms", type=float, default=None,
                   help="rank 1's extra sleep per step (default: one measured BSP step)")
    g.add_argument("--jitter-ms", type=float, default=None,
                   help="mean of every rank's random sleep per step in the transient-delay "
                        "runs (default: a third of one measured BSP step)")
    g.add_argument("--async-rounds", type=int, default=2,
                   help="rounds of the four modes without a straggler")
    g.add_argument("--async-baseline", metavar="DIR", default=None,
                   help="another kvcoll checkout (its C extension built) whose SSP/ASP runs "
                        "(mode names ending in -before) are interleaved with this one's in "
                        "every scenario: a change's before and after in one run")
    g.add_argument("--async-retries", type=int, default=2,
                   help="times a run disturbed by other processes (more than "
                        "0.3 CPUs of theirs during it) is run again; the least disturbed "
                        "attempt is kept")
    g.add_argument("--async-quiet-wait", type=float, default=300,
                   help="seconds each run may wait for the machine to be quiet")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU ticks of the whole machine so far, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _train(args: list[str], out: str, timeout: float, root: str = common.ROOT) -> dict:
    """One launch of examples/train.py (of the checkout at `root`) on 2 ranks; its
    metrics, with others_busy_cores: the CPUs other processes used meanwhile (the
    machine's busy time less this launch's)."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    train = os.path.join(root, "examples", "train.py")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable, train,
           "--no-progress", "--log-every", "100000", "--metrics-out", out, *args]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=root)
    env.pop("KVCOLL_STEP_MODE", None)
    env.pop("KVCOLL_STALENESS", None)
    b0, t0, c0, w0 = *_machine_busy(), _children_cpu(), time.monotonic()
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True,
                          cwd=root)
    b1, t1, c1, w1 = *_machine_busy(), _children_cpu(), time.monotonic()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        m = json.load(f)
    busy = (os.cpu_count() or 1) * (b1 - b0) / max(1, t1 - t0)
    m["others_busy_cores"] = max(0.0, busy - (c1 - c0) / max(1e-9, w1 - w0))
    return m


SCENARIOS = ("none", "straggler", "jitter")
DISTURBED = 0.3   # other processes' CPUs during a run above which it is run again


def run(args) -> None:
    steps = 30 if args.quick else args.async_steps
    batch = 1024 if args.quick else args.async_batch
    evals = 8192 if args.quick else 50_000
    rounds = 1 if args.quick else max(1, args.async_rounds)
    wait = 0 if args.quick else args.async_quiet_wait
    retries = 0 if args.quick else args.async_retries
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    base = ["--steps", str(steps), "--batch-size", str(batch), "--eval-samples", str(evals)]
    records = []
    delay = {"straggler": args.slow_ms, "jitter": args.jitter_ms}
    modes = [(m, f, common.ROOT) for m, f in MODES]
    if args.async_baseline:
        modes += [(f"{m}-before", f, os.path.abspath(args.async_baseline))
                  for m, f in MODES if m != "bsp"]
    plan = [("none", rnd, modes[rnd % len(modes):] + modes[:rnd % len(modes)])
            for rnd in range(rounds)]
    plan += [(sc, 0, modes) for sc in ("straggler", "jitter")]
    with tempfile.TemporaryDirectory() as tmp:
        for scenario, rnd, order in plan:
            for name, flags, root in order:
                extra, note = [], ""
                if scenario == "straggler":
                    extra = ["--slow-rank", "1", "--slow-ms", f"{delay['straggler']:g}"]
                    note = f" with rank 1 slowed by {delay['straggler']:g} ms"
                elif scenario == "jitter":
                    extra = ["--jitter-ms", f"{delay['jitter']:g}"]
                    note = f" with every rank delayed {delay['jitter']:g} ms on average"
                m = None
                for attempt in range(1 + retries):
                    busy = common.wait_until_quiet(wait, below=0.5)
                    print(f"[async] {name}{note} (round {rnd}; other processes busy: "
                          f"{busy:.1f} cores)", flush=True)
                    got = _train(base + flags + extra,
                                 os.path.join(tmp, f"{name}-{scenario}-{rnd}.json"),
                                 timeout=3600, root=root)
                    got["attempts"] = attempt + 1
                    if m is None or got["others_busy_cores"] < m["others_busy_cores"]:
                        m = got
                    if m["others_busy_cores"] <= DISTURBED:
                        break
                    print(f"[async] others used {got['others_busy_cores']:.2f} CPUs during "
                          "that run: run again", flush=True)
                rec = {k: m.get(k) for k in (
                    "step_mode", "staleness", "world_size", "global_batch_size", "steps",
                    "local_steps", "samples_per_sec", "steps_per_sec", "max_staleness_observed",
                    "max_clock_lead", "eval_auc", "planted_auc", "eval_samples",
                    "timings_ms_per_step", "train_seconds", "others_busy_cores", "attempts")}
                rec.update(mode=name, scenario=scenario, round=rnd, root=root,
                           straggler=scenario == "straggler",
                           slow_ms=delay["straggler"] if scenario == "straggler" else 0.0,
                           jitter_ms=delay["jitter"] if scenario == "jitter" else 0.0,
                           busy_cores_before=busy)
                records.append(rec)
                step_ms = m["timings_ms_per_step"]["total"]
                if delay["straggler"] is None:  # about one normal step, from the first run
                    delay["straggler"] = float(round(step_ms))
                if delay["jitter"] is None:     # about a third of one
                    delay["jitter"] = float(round(step_ms / 3))
    _annotate(records, batch)
    common.publish(out_dir, "async", records, lambda m: markdown(records, steps, batch, m))


def _get(records, mode, scenario, rnd=None):
    """The record of `mode` in `scenario` (without a straggler: of round rnd, default
    the median round's, see _median_round)."""
    if scenario == "none" and rnd is None:
        rnd = _median_round(records)
    return next(r for r in records if r["mode"] == mode and r["scenario"] == scenario
                and (rnd is None or r["round"] == rnd))


def _median_round(records) -> int:
    """The round without a straggler whose worst SSP/ASP-to-BSP ratio is the median."""
    rounds = sorted({r["round"] for r in records if r["scenario"] == "none"})
    worst = sorted((min(_get(records, m, "none", k)["vs_bsp_samples_per_sec"]
                        for m in ("ssp1", "ssp4", "asp")), k) for k in rounds)
    return worst[(len(worst) - 1) // 2][1]


def _annotate(records, batch) -> None:
    """Each run's ratios to BSP (in its scenario and round), and with the straggler the
    ideal throughput and each run's ratio to it."""
    for r in records:
        bsp = _get(records, "bsp", r["scenario"], r["round"])
        r["vs_bsp_samples_per_sec"] = r["samples_per_sec"] / bsp["samples_per_sec"]
        r["auc_minus_bsp"] = r["eval_auc"] - bsp["eval_auc"]
    free = _get(records, "asp", "none")
    per_rank = [batch // 2, batch - batch // 2]
    step_s = [1.0 / s for s in free["steps_per_sec"]]
    for r in records:
        if r["scenario"] == "straggler":
            extra = [0.0, r["slow_ms"] / 1e3]
            r["ideal_samples_per_sec"] = sum(b / (s + e)
                                             for b, s, e in zip(per_rank, step_s, extra))
            r["vs_ideal"] = r["samples_per_sec"] / r["ideal_samples_per_sec"]


def _before_line(records, before: list[str], rounds: list[int]) -> list[str]:
    """The summary line of the baseline checkout's runs (modes named x-before), if any."""
    if not before:
        return []
    worst = statistics.median(
        min(_get(records, m, "none", k)["vs_bsp_samples_per_sec"] for m in before)
        for k in rounds)
    jitter = ", ".join(f"{NAMES[m[:-len('-before')]]} "
                       f"{_get(records, m, 'jitter')['vs_bsp_samples_per_sec']:.2f}x"
                       for m in before)
    return [f"- before this change (the SSP/ASP runs of "
            f"{_get(records, before[0], 'none')['root']}, interleaved in this run): the "
            f"slowest of SSP/ASP without a straggler at {worst:.2f}x BSP; with transient "
            f"delays on every rank {jitter} BSP's throughput"]


def markdown(records, steps, batch, machine) -> str:
    slow = _get(records, "bsp", "straggler")["slow_ms"]
    jitter = _get(records, "bsp", "jitter")["jitter_ms"]
    rounds = sorted({r["round"] for r in records if r["scenario"] == "none"})
    median = _median_round(records)
    others = [r["others_busy_cores"] for r in records if r.get("others_busy_cores") is not None]
    names = list(dict.fromkeys(r["mode"] for r in records))   # bsp, ssp1, ..., x-before
    lines = [
        "# Step modes without and with delays (DeepFM, synthetic CTR data, 2 ranks)",
        "",
        f"`./dev bench async` — {steps} steps per rank, global batch {batch}; straggler: rank 1 "
        f"sleeps {slow:g} ms per step (about one normal step); transient delays: before "
        f"each step every rank sleeps a random time, exponential with a mean of {jitter:g} ms "
        f"(about a third of a step), seeded per rank; {machine['cpu']}, "
        f"{machine['cores']} cores, {machine.get('date', '')}. Throughput: the sum of every "
        "rank's own rate; ideal: each rank's unimpeded rate (its step time in the "
        "straggler-free ASP run, plus the sleep), summed; above 100% when the sleeping "
        "straggler leaves its core to the fast rank. Other processes used "
        f"{statistics.median(others) if others else float('nan'):.2f} CPUs during a run "
        f"(median; at most {max(others) if others else float('nan'):.2f}): the machine is "
        "shared.",
        "",
        f"Without a straggler: {len(rounds)} round(s) of the four modes (order rotated); each "
        "ratio to BSP is within its round:",
        "",
        "| round | " + " | ".join(names[1:]) + " | BSP samples/s | others' CPUs |",
        "|---|" + "---|" * (len(names) - 1) + "---|---|",
    ]
    for k in rounds:
        rs = [_get(records, m, "none", k) for m in names]
        lines.append(f"| {k}{' (median)' if k == median else ''} | "
                     + " | ".join(f"{r['vs_bsp_samples_per_sec']:.2f}x" for r in rs[1:])
                     + f" | {rs[0]['samples_per_sec']:,.0f} | "
                     + f"{max(r.get('others_busy_cores') or 0.0 for r in rs):.2f} |")
    lines += [
        "",
        "| delays | mode | samples/s | vs BSP | vs ideal | steps/s per rank | "
        "max staleness | eval AUC | AUC - BSP | others' CPUs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    label = {"none": "none", "straggler": "straggler", "jitter": "jitter (all ranks)"}
    for scenario in SCENARIOS:
        for m in names:
            r = _get(records, m, scenario)
            ideal = f"{r['vs_ideal']:.0%}" if "vs_ideal" in r else ""
            sps = " / ".join(f"{x:.1f}" for x in r["steps_per_sec"])
            lines.append(
                f"| {label[scenario]} | {r['mode']} | {r['samples_per_sec']:,.0f} | "
                f"{r['vs_bsp_samples_per_sec']:.2f}x | {ideal} | {sps} | "
                f"{r['max_staleness_observed']} | {r['eval_auc']:.4f} | "
                f"{r['auc_minus_bsp']:+.4f} | {r.get('others_busy_cores') or 0.0:.2f} |")
    asp = _get(records, "asp", "straggler")
    worst_free = [min(_get(records, m, "none", k)["vs_bsp_samples_per_sec"]
                      for m in ("ssp1", "ssp4", "asp")) for k in rounds]
    jit = {m: _get(records, m, "jitter") for m in ("ssp1", "ssp4", "asp")}
    before = [m for m in names if m.endswith("-before")]
    lines += [
        "",
        f"- with the straggler, ASP reaches {asp['vs_ideal']:.0%} of the ideal throughput "
        f"(target >= 90%) at {asp['auc_minus_bsp']:+.4f} AUC from BSP (target within 0.01); "
        f"SSP(1) {_get(records, 'ssp1', 'straggler')['vs_ideal']:.0%}, SSP(4) "
        f"{_get(records, 'ssp4', 'straggler')['vs_ideal']:.0%}, BSP "
        f"{_get(records, 'bsp', 'straggler')['vs_ideal']:.0%}",
        f"- without a straggler, the slowest of SSP/ASP runs at "
        f"{statistics.median(worst_free):.2f}x BSP (median of {len(rounds)} round(s): "
        + ", ".join(f"{w:.2f}x" for w in worst_free) + "; target >= 0.98x)",
        *_before_line(records, before, rounds),
        "- with transient delays on every rank: "
        + ", ".join(f"{NAMES[m]} {r['vs_bsp_samples_per_sec']:.2f}x BSP's throughput "
                    f"({r['auc_minus_bsp']:+.4f} AUC)" for m, r in jit.items()),
        "",
    ]
    return "\n".join(lines)
