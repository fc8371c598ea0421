"""Elastic training: a lost rank or host on three network-namespace hosts, timed.

    python -m bench elastic            # opt-in (a training job per event): ~10 minutes
    python -m bench elastic --quick    # a smoke test: fewer steps, kill and fresh only

Three "hosts" (tests/launch/netns.py: network namespaces joined by veth links, Open MPI
over TCP between them), one rank each, `launch/kvcollrun --elastic --min-np 2`; the
job (bench/elastic_job.py) trains the DeepFM demo (examples/models.py) through
model.fit on SyntheticCTR's global batches, BSP, with kv.callbacks.Checkpoint saving a
delta every 10 steps and a full checkpoint every 100, restoring at start. Each event in
its own job, rank 2 (on kvhost3) lost once it has trained --kill-at steps:

- kill: SIGKILL of the rank (its host stays up): the survivors continue in memory;
- stop: SIGSTOP of the rank (a silent process, found by the heartbeat), in memory;
- link: host 3's link goes down (`ip link set eth0 down` in its namespace): the
  survivors recover in memory, then Open MPI's runtime ends the job (it lost the host's
  daemon) and kvcollrun relaunches it on the two hosts left, from the latest
  checkpoint;
- relaunch: SIGKILL of the rank in a job without in-memory recovery (the job drops its
  engine's elastic session, as a non-elastic or SSP engine has none): the job ends and
  kvcollrun relaunches it on the two hosts left from the latest checkpoint (the
  torchrun-style recovery, for comparison);
- kill1m, kill10m: the kill, in a job (80 steps, lost after step 25) whose ranks each
  create 1M (10M) more rows at step 1 (bench/elastic_job.py --prefill), saved at step
  10: the recovery against the rows the lost rank held;
- fresh: a fresh 2-rank run on hosts 1 and 2 (same launcher, same model, same global
  batch), once before the events and once after: the baseline of the throughput after
  the shrink.

Measured, per event: the time from the fault (the bench's own clock when it sent the
signal or cut the link) to the first step applied afterwards on the survivors (every
rank writes a timeline of its steps; the namespaces share this kernel's clock), and,
for a relaunch, to the first step of the relaunched job; the event's own timings as
kvcoll recorded them (kvcoll.elastic.events(): seconds from the loss as the survivors
saw it); rows reverted (the lost shard's rows since its last save, refilled from the
chain); the rows the lost rank held; the steps redone after a relaunch; samples/s of
the survivors after the shrink (from the 5th step after the first one, to the end)
against the fresh 2-rank runs over the same steps. The other processes' load (busy
cores, measured before each job while the bench idles) is recorded with each job.

Writes bench/results/elastic.json, elastic.md and (when matplotlib is installed)
elastic.png: samples/s over time with the events marked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time

from . import common

TARGETS = {"kill": 5.0, "stop": 10.0, "link": 30.0,     # seconds, fault -> training again
           "kill1m": 5.0, "kill10m": 5.0}
PREFILL = {"kill1m": 1_000_000, "kill10m": 10_000_000}   # rows each rank creates at step 1
PREFILL_STEPS, PREFILL_KILL_AT = 80, 25
THROUGHPUT_TARGET = 0.95
SKIP_AFTER = 5       # steps after the first step after a loss before the rate is taken
WARMUP = 10          # steps of a fresh run not timed (tracing, first allocations)
EVENTS = ("kill", "stop", "link", "relaunch", "kill1m", "kill10m")


def add_arguments(p) -> None:
    g = p.add_argument_group("elastic")
    g.add_argument("--elastic-steps", type=int, default=600, help="steps per job")
    g.add_argument("--elastic-kill-at", type=int, default=205,
                   help="rank 2 is lost once it has applied this step")
    g.add_argument("--elastic-batch", type=int, default=4096, help="global batch")
    g.add_argument("--elastic-vocab", type=int, default=1_000_000, help="ids per field")
    g.add_argument("--elastic-events", default=",".join(EVENTS),
                   help=f"which events (comma-separated of {', '.join(EVENTS)})")
    g.add_argument("--elastic-timeout", type=float, default=600,
                   help="seconds a job may take before it is killed")
    g.add_argument("--elastic-pairs", type=int, default=3,
                   help="kill / fresh pairs in all (the first kill is the event's own): "
                        "the throughput after the shrink, repeated")
    g.add_argument("--elastic-logs", default=None,
                   help="a directory to keep each job's whole output in (<kind>.txt)")


# -- one job -------------------------------------------------------------------------------

def start_job(hosts, which: list[int], job_args: list, flags: list):
    """kvcollrun --elastic on the hosts (a tests/launch/netns.py Job: its output lines
    with their arrival times, on the wall clock the job's timeline uses)."""
    import netns  # (run() put tests/launch on the path)

    mpi = hosts.mpi_args(hosts.hostfile_for(which, slots=[1] * len(which)))
    return netns.Job([os.path.join(common.ROOT, "launch", "kvcollrun"), "--elastic", *flags,
                      *mpi, sys.executable,
                      os.path.join(common.ROOT, "bench", "elastic_job.py"), *job_args],
                     hosts.env({"KVCOLLRUN_KILL_AFTER": "5"}), clock=time.time)


def read_timeline(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]
    except FileNotFoundError:
        return []


def wait_for_step(path: str, step: int, job, timeout: float) -> dict | None:
    """Rank 2's timeline line of `step` (or later), None if the job ended or timed out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        for rec in read_timeline(path):
            if rec["step"] >= step:
                return rec
        time.sleep(0.02)
    return None


def run_job(hosts, kind: str, tmp: str, args, steps: int) -> dict:
    """One job of `kind` (fresh, or an event in EVENTS): its record."""
    kill_at = args.kill_at
    if kind in PREFILL:
        steps, kill_at = min(steps, PREFILL_STEPS), min(kill_at, PREFILL_KILL_AT)
    d = os.path.join(tmp, kind)
    os.makedirs(d, exist_ok=True)
    timeline, out = os.path.join(d, "timeline"), os.path.join(d, "out.json")
    job_args = ["--steps", steps, "--batch", args.batch, "--vocab", args.vocab,
                "--ckpt", os.path.join(d, "ck"), "--timeline", timeline, "--out", out]
    if kind == "relaunch":
        job_args.append("--no-in-memory")
    if kind != "fresh":
        job_args += ["--dirty-from", kill_at]
    if kind in PREFILL:
        job_args += ["--prefill", PREFILL[kind]]
    flags = ["--min-np", 2, "--cooldown", 600, "--elastic-timeout", 0]
    which = [0, 1] if kind == "fresh" else [0, 1, 2]
    others = common.busy_cores(2.0)
    rec = {"kind": kind, "world": len(which), "steps": steps, "global_batch": args.batch,
           "vocab_per_field": args.vocab, "kill_at": kill_at,
           "prefill_rows_per_rank": PREFILL.get(kind, 0),
           "others_busy_cores": round(others, 2)}
    print(f"[elastic] {kind}: {len(which)} host(s), {steps} steps; others busy "
          f"{others:.2f} cores", flush=True)
    job = start_job(hosts, which, job_args, flags)
    t_fault = None
    try:
        if kind != "fresh":
            at = wait_for_step(timeline + ".rank2", kill_at, job, args.timeout)
            if at is None:
                rec["error"] = f"rank 2 never reached step {kill_at}"
            else:
                victim = hosts.ranks(2, "elastic_job.py")
                if len(victim) != 1:
                    rec["error"] = f"not one rank process on kvhost3: {victim}"
                else:
                    t_fault = time.time()
                    if kind == "stop":
                        os.kill(victim[0], signal.SIGSTOP)
                    elif kind == "link":
                        hosts.link_down(2)
                    else:   # kill, relaunch, kill1m, kill10m
                        os.kill(victim[0], signal.SIGKILL)
                    rec["fault_after_step"] = at["step"]
        code = job.end(args.timeout)
    finally:
        job.kill()
        hosts.link_up(2)
        for i in range(3):
            hosts.kill_all(i)
    rec["exit_code"] = code
    text = job.text()
    if code != 0:
        rec.setdefault("error", f"exit code {code}: " + " | ".join(text.splitlines()[-6:])[:600])
    rec.update(analyse(kind, timeline, out, text, t_fault, args.batch, steps))
    if args.elastic_logs:
        os.makedirs(args.elastic_logs, exist_ok=True)
        with open(os.path.join(args.elastic_logs, f"{kind}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    rec["output_tail"] = text.splitlines()[-(300 if "error" in rec else 15):]
    print(f"[elastic] {kind}: " + json.dumps({k: v for k, v in rec.items()
                                              if k not in ("output_tail", "samples")}),
          flush=True)
    return rec


# -- what a job's files say ----------------------------------------------------------------

def rate(tl: list[dict], batch: int, first: int, last: int | None = None) -> float | None:
    """Samples/s over steps (first, last] of one launch's timeline (rank 0's)."""
    pts = [r for r in tl if r["step"] >= first and (last is None or r["step"] <= last)]
    if len(pts) < 3:
        return None
    return (pts[-1]["step"] - pts[0]["step"]) * batch / (pts[-1]["t"] - pts[0]["t"])


def samples_over_time(tl: list[dict], batch: int, t0: float, window: int = 10) -> list:
    """[seconds since t0, samples/s over the last `window` steps] per step of rank 0."""
    out = []
    for i in range(window, len(tl)):
        a, b = tl[i - window], tl[i]
        if b["launch"] == a["launch"] and b["t"] > a["t"]:
            out.append([round(b["t"] - t0, 3),
                        round((b["step"] - a["step"]) * batch / (b["t"] - a["t"]), 1)])
    return out


def analyse(kind, timeline, out, text, t_fault, batch, steps) -> dict:
    tl = read_timeline(timeline + ".rank0")
    res: dict = {}
    if not tl:
        return res
    t0 = tl[0]["t"]
    res["samples"] = samples_over_time(tl, batch, t0)
    res["last_step"] = tl[-1]["step"]
    try:
        with open(out, encoding="utf-8") as f:
            got = json.load(f)
        res["events"], res["world_changes"] = got["events"], got["seen"]
    except (OSError, ValueError):
        pass
    m = re.findall(r"Checkpoint: restored (ckpt-\d+)\S* from \S+ \(step (\d+)", text)
    if m:
        res["restored"] = [{"checkpoint": c, "step": int(s)} for c, s in m]
    res["relaunched"] = bool(re.search(r"kvcollrun: lost .*relaunching on", text))
    if kind == "fresh":
        res["samples_per_sec"] = rate(tl, batch, WARMUP)
        # each step's time (s from the first), for the rate over an event's window
        res["step_times"] = {"first": tl[0]["step"], "t": [round(r["t"] - t0, 4) for r in tl]}
        return res
    if t_fault is None:
        return res
    res["fault_at_s"] = round(t_fault - t0, 3)
    lost = [r for r in read_timeline(timeline + ".rank2") if r["t"] <= t_fault]
    if lost:
        res["lost_rank_rows"] = lost[-1]["rows"]
        res["lost_rank_last_step"] = lost[-1]["step"]
        res["lost_rank_rows_changed_since_save"] = lost[-1].get("dirty")
    before = [r for r in tl if r["t"] <= t_fault]
    after = [r for r in tl if r["t"] > t_fault and r["world"] == 2]
    if before:
        res["rate_before"] = rate(before, batch, WARMUP)
    launch0 = before[-1]["launch"] if before else 1
    mem = [r for r in after if r["launch"] == launch0]
    rel = [r for r in after if r["launch"] > launch0]
    if mem:   # the survivors went on in memory
        res["in_memory_first_step_s"] = round(mem[0]["t"] - t_fault, 3)
        res["in_memory_first_step"] = mem[0]["step"]
        res["rate_after"] = rate(mem, batch, mem[0]["step"] + SKIP_AFTER)
        res["rate_window"] = [mem[0]["step"] + SKIP_AFTER, mem[-1]["step"]]
    if rel:   # ... and/or a relaunch trained again
        res["relaunch_first_step_s"] = round(rel[0]["t"] - t_fault, 3)
        res["relaunch_first_step"] = rel[0]["step"]
        # the last step trained before the relaunch (in memory after the fault, if the
        # survivors went on), less the step the relaunch restored
        trained = mem[-1]["step"] if mem else (before[-1]["step"] if before else 0)
        res["steps_redone"] = trained - rel[0]["step"] + 1
        if not mem:
            res["rate_after"] = rate(rel, batch, rel[0]["step"] + SKIP_AFTER)
            res["rate_window"] = [rel[0]["step"] + SKIP_AFTER, rel[-1]["step"]]
    times = [x for x in (res.get("in_memory_first_step_s"), res.get("relaunch_first_step_s"))
             if x is not None]
    if times:   # training for good on the survivors: the relaunch's when there was one
        res["recovery_s"] = res.get("relaunch_first_step_s") or res["in_memory_first_step_s"]
    return res


# -- the report ----------------------------------------------------------------------------

def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def window_rate(fresh: dict, window, batch: int) -> float | None:
    """A fresh run's samples/s over the steps of `window` ([first, last])."""
    st = fresh.get("step_times")
    if not st or not window:
        return None
    a, b = window[0] - st["first"], window[1] - st["first"]
    if a < 0 or b >= len(st["t"]) or b <= a:
        return None
    return (b - a) * batch / (st["t"][b] - st["t"][a])


def label(records: list[dict], i: int) -> str:
    """A job's name in the report: its kind, and "#n" for the n-th job of a kind."""
    n = sum(1 for r in records[:i + 1] if r["kind"] == records[i]["kind"])
    return records[i]["kind"] + (f" #{n}" if n > 1 else "")


def summary(records: list[dict]) -> dict:
    """The baseline and, per event, its numbers against the targets. The throughput
    after the shrink is compared with the fresh runs' rate over the same steps (the
    tables grow as a run goes on, so later steps cost more)."""
    fresh = [r["samples_per_sec"] for r in records
             if r["kind"] == "fresh" and r.get("samples_per_sec")]
    out = {"fresh_2_rank_samples_per_sec": fresh, "events": {}}
    for i, r in enumerate(records):
        if r["kind"] in ("fresh", "summary"):
            continue
        ev = (r.get("events") or [{}])[0]
        target = TARGETS.get(r["kind"])
        rec_s = r.get("recovery_s")
        # the baseline: the fresh runs next to this job, the last before and the first after
        near = [f for f in records[i::-1] if f["kind"] == "fresh"][:1] + \
            [f for f in records[i:] if f["kind"] == "fresh"][:1]
        same = [x for x in (window_rate(f, r.get("rate_window"), r.get("global_batch", 0))
                            for f in near) if x]
        base = statistics.median(same) if same else None
        ratio = r["rate_after"] / base if base and r.get("rate_after") else None
        out["events"][label(records, i)] = {
            "kind": r["kind"], "recovery_s": rec_s, "target_s": target,
            "met": None if target is None or rec_s is None else rec_s <= target,
            "in_memory_first_step_s": r.get("in_memory_first_step_s"),
            "relaunch_first_step_s": r.get("relaunch_first_step_s"),
            "event": ev, "rows_reverted": ev.get("rows_reverted"),
            "lost_rank_rows": r.get("lost_rank_rows"),
            "rows_changed_since_save": r.get("lost_rank_rows_changed_since_save"),
            "steps_redone": r.get("steps_redone"),
            "fresh_same_steps": same, "throughput_ratio": ratio,
            "throughput_met": None if ratio is None else ratio >= THROUGHPUT_TARGET,
            "error": r.get("error")}
    return out


def markdown(records: list[dict], machine: dict, command: str, png: str | None) -> str:
    s = summary(records)
    first = records[0] if records else {}
    lines = [
        "# Elastic training: a lost rank or host, timed",
        "",
        f"`{command}`. Three network-namespace hosts (tests/launch/netns.py, Open MPI over "
        f"TCP), one rank each, `launch/kvcollrun --elastic --min-np 2`; the DeepFM demo "
        f"through model.fit (bench/elastic_job.py), BSP, global batch "
        f"{first.get('global_batch', '?')}, {first.get('steps', '?')} steps, 8 fields of "
        f"{first.get('vocab_per_field', 0):,} ids, kv.callbacks.Checkpoint: a delta every 10 "
        f"steps, a full checkpoint every 100. Rank 2 (kvhost3) lost once it had applied "
        f"step {first.get('kill_at', '?')}. Each event in its own job. Machine: "
        f"{machine.get('cpu', '?')}, "
        f"{machine.get('cores', '?')} cores, shared: 3 ranks on "
        f"{machine.get('cores', '?')} cores, and other processes' load as listed "
        f"(busy cores measured before each job).",
        "",
        "Recovery: the bench's clock from the fault (signal sent, link cut) to the first "
        "step applied afterwards on the survivors (rank 0's timeline). For a relaunch, to "
        "the first step of the relaunched job.",
        "",
        "Rows: what the lost rank held when it was lost; of them, the rows it had created "
        "or changed since its last save (its dirty rows: the work the loss reverts); "
        "kvcoll's `rows_reverted` (the rows the survivors refilled from the chain: the "
        "lost shard as of its last save, changed or not). Steps redone: after a relaunch, "
        "the steps trained again (the survivors' work since the last save is redone too).",
        "",
        "| event | others busy (cores) | fault -> first step in memory (s) | fault -> first "
        "step after relaunch (s) | target | met | kvcoll's timings: detect / agree / shrink / "
        "refill / first step (s from the loss) | rows the lost rank held | changed since "
        "its last save | rows_reverted (refilled) | steps redone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"kill": "SIGKILL, in memory", "stop": "SIGSTOP, in memory",
             "link": "link down (host lost)", "relaunch": "SIGKILL, relaunch fallback",
             "kill1m": "SIGKILL, in memory, +1M rows/rank", "kill10m":
             "SIGKILL, in memory, +10M rows/rank"}
    byk = {label(records, i): r for i, r in enumerate(records)}

    def name(lab):   # "kill #2" -> "SIGKILL, in memory #2"
        kind, _, n = lab.partition(" ")
        return names.get(kind, kind) + (f" {n}" if n else "")
    for kind, e in s["events"].items():
        ev = e["event"]
        timings = " / ".join(_f(ev.get(k), "{:.3f}") for k in (
            "detect_s", "agree_s", "shrink_s", "refill_s", "first_step_after_s")) if ev else "-"
        met = "-" if e["met"] is None else ("met" if e["met"] else "NOT met")
        if e["error"]:
            met += f" (error: {e['error'][:120]})"
        lines.append(
            f"| {name(kind)} | {byk[kind].get('others_busy_cores', '?')} | "
            f"{_f(e['in_memory_first_step_s'])} | {_f(e['relaunch_first_step_s'])} | "
            f"{'<= %g s' % e['target_s'] if e['target_s'] else 'comparison'} | {met} | "
            f"{timings} | {_f(e['lost_rank_rows'], '{:,}')} | "
            f"{_f(e['rows_changed_since_save'], '{:,}')} | "
            f"{_f(e['rows_reverted'], '{:,}')} | {_f(e['steps_redone'], '{:,}')} |")
    fresh = [r for r in records if r["kind"] == "fresh"]
    lines += [
        "",
        "## Throughput after the shrink",
        "",
        f"Samples/s of the 2 survivors from the {SKIP_AFTER}th step after the first step "
        f"after the loss to the end, against fresh 2-rank runs on hosts 1 and 2 (same "
        f"launcher, model and global batch) over the same steps (the tables grow as a run "
        f"goes on, so later steps cost more): {len(fresh)} fresh runs in this bench run, "
        f"interleaved with the events; each event's ratio is to the mean of the fresh runs "
        f"right before and right after it (the machine's other load changes in between). "
        f"Target >= {THROUGHPUT_TARGET:.0%}.",
        "",
        "| run | others busy (cores) | samples/s | fresh 2-rank, same steps | ratio | "
        "target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in fresh:
        lines.append(f"| fresh 2-rank (steps {WARMUP} to the end) | "
                     f"{r.get('others_busy_cores', '?')} | "
                     f"{_f(r.get('samples_per_sec'), '{:,.0f}')} | - | - | - | - |")
    for kind, e in s["events"].items():
        r = byk[kind]
        if e["kind"] in PREFILL:   # (a short job with more rows: not this comparison)
            continue
        met = "-" if e["throughput_met"] is None else (
            "met" if e["throughput_met"] else "NOT met")
        lines.append(f"| after: {name(kind)} (steps {r.get('rate_window', '?')}) | "
                     f"{r.get('others_busy_cores', '?')} | "
                     f"{_f(r.get('rate_after'), '{:,.0f}')} | "
                     + (", ".join(f"{x:,.0f}" for x in e["fresh_same_steps"]) or "-") +
                     f" | {_f(e['throughput_ratio'], '{:.1%}')} | >= 95% | {met} |")
    kills = [e["throughput_ratio"] for e in s["events"].values()
             if e["kind"] == "kill" and e["throughput_ratio"] is not None]
    if len(kills) > 1:
        med = statistics.median(kills)
        lines += ["", f"The {len(kills)} SIGKILL runs: median {med:.1%} of the fresh runs beside "
                  f"them (range {min(kills):.1%} to {max(kills):.1%}): "
                  f"{'met' if med >= THROUGHPUT_TARGET else 'NOT met'} on the median."]
    lines += ["", "3-rank samples/s before the fault, for reference: " + ", ".join(
        f"{k} {_f(byk[k].get('rate_before'), '{:,.0f}')}" for k in s["events"]) + "."]
    notes = observations(records)
    if notes:
        lines += ["", "## Observations (from this run's records)", ""] + [f"- {n}" for n in notes]
    if png:
        lines += ["", f"![samples/s over time, events marked]({os.path.basename(png)})"]
    else:
        lines += ["", "(No plot: matplotlib is not installed in .venv.)"]
    if not any(e["kind"] in PREFILL for e in s["events"].values()):
        lines += ["", "Not measured here: recovery time against the rows the lost shard held "
                  "at 1M and 10M rows (--elastic-events kill1m,kill10m)."]
    else:
        lines += ["", f"+1M/+10M rows: the job ({PREFILL_STEPS} steps) has each rank create "
                  "that many more rows at step 1 (saved at step 10), and the rank is lost "
                  f"after step {PREFILL_KILL_AT}: the refill reads the lost shard's rows "
                  "from the chain; its time is kvcoll's refill_s less shrink_s."]
    return "\n".join(lines) + "\n"


def observations(records: list[dict]) -> list[str]:
    """What the records show beyond the table: jobs that failed, slow agreements, events
    kvcoll recorded with no rank lost, jobs that trained past their steps, no in-memory step before a
    relaunch."""
    out = []
    for r in records:
        k = r["kind"]
        if r.get("error"):
            out.append(f"{k}: the job failed and is left out of the tables: {r['error']}")
        for ev in r.get("events") or []:
            d, a = ev.get("detect_s"), ev.get("agree_s")
            if d is not None and a is not None and a - d > 5:
                out.append(f"{k}: the survivors' agreement completed {a - d:.1f} s after they "
                           f"detected the loss (detect {d:.2f} s, agree {a:.2f} s): the "
                           "recovery waited for it.")
            if ev.get("kind") == "lost" and not ev.get("ranks"):
                out.append(f"{k}: kvcoll recorded a `lost` event with no rank lost "
                           f"(world {ev.get('world')}, step {ev.get('step')}, rows_reverted "
                           f"{ev.get('rows_reverted')}) in the last launch.")
        if r.get("last_step") and r.get("steps") and r["last_step"] > r["steps"]:
            at = (r.get("restored") or [{}])[0].get("step")
            out.append(f"{k}: the job trained to step {r['last_step']} of {r['steps']}: the "
                       f"relaunch restored step {at}, then fit ran "
                       f"{r['last_step'] - (at or 0)} more steps (the data source's whole "
                       "pass, not the steps left).")
        if k == "link" and r.get("relaunch_first_step_s") is not None and \
                r.get("in_memory_first_step_s") is None:
            out.append("link: no step ran in memory on the survivors before the runtime ended "
                       "the job; the relaunch carried on.")
    return out


def plot(records: list[dict], path: str) -> str | None:
    """samples/s over time, one panel per job, the fault marked; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in records if r.get("samples")]
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.2 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        xs, ys = zip(*r["samples"])
        ax.plot(xs, ys, ".", ms=2)
        if r.get("fault_at_s") is not None:
            ax.axvline(r["fault_at_s"], color="r", label="fault")
            if r.get("recovery_s") is not None:
                ax.axvline(r["fault_at_s"] + r["recovery_s"], color="g", label="training again")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_title(r["kind"], fontsize=9)
        ax.set_ylabel("samples/s")
    axes[-1, 0].set_xlabel("seconds since the first step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


# -- the whole run -------------------------------------------------------------------------

def run(args) -> None:
    sys.path.insert(0, os.path.join(common.ROOT, "tests", "launch"))
    import netns

    quick = args.quick
    args.batch, args.vocab = args.elastic_batch, args.elastic_vocab
    args.timeout = args.elastic_timeout
    steps = 60 if quick else args.elastic_steps
    args.kill_at = 25 if quick else args.elastic_kill_at
    kinds = [k for k in args.elastic_events.split(",") if k]
    if quick and args.elastic_events == ",".join(EVENTS):   # (unless named)
        kinds = ["kill"]
    bad = [k for k in kinds if k not in EVENTS]
    if bad:
        raise SystemExit(f"--elastic-events: unknown {bad}; choose from {', '.join(EVENTS)}")
    out_dir = args.out or (tempfile.mkdtemp() if quick else common.RESULTS)
    reason = netns.Hosts.unavailable()
    if reason:
        raise SystemExit(f"[elastic] cannot make the test hosts: {reason}")
    command = "./dev bench elastic" + (" --quick" if quick else "")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = netns.Hosts.create(3, os.path.join(tmp, "hosts"))
        try:
            records.append(run_job(hosts, "fresh", tmp + "/a", args, steps))
            for kind in kinds:
                records.append(run_job(hosts, kind, tmp, args, steps))
            if not quick:
                records.append(run_job(hosts, "fresh", tmp + "/b", args, steps))
                for n in range(2, args.elastic_pairs + 1 if "kill" in kinds else 0):
                    records.append(run_job(hosts, "kill", f"{tmp}/k{n}", args, steps))
                    records.append(run_job(hosts, "fresh", f"{tmp}/f{n}", args, steps))
        finally:
            hosts.close()
    os.makedirs(out_dir, exist_ok=True)
    png = plot(records, os.path.join(out_dir, "elastic.png"))
    for r in records:
        r["summary"] = None
    s = summary(records)
    records.append({"kind": "summary", **s})
    common.publish(out_dir, "elastic", records,
                   lambda m: markdown([r for r in records if r["kind"] != "summary"], m,
                                      command, png))
