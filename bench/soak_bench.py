"""Soak: hours of training in minutes' worth of churn; resident memory must stay flat.

Runs examples/train.py (DeepFM, synthetic data, 26 tables of Zipf ids over 10^7) on 2
ranks under launch/kvcollrun for --soak-minutes (default 10) with the feature lifecycle
on (admission after 2 sightings, eviction after 500 idle steps and beyond a row budget
of 20,000 rows per table) and checkpoints every few hundred steps (incremental, with a
full one every ten). Every --soak-sample seconds it reads each rank's resident set size
(VmRSS) and the step. At the end it stops the ranks with SIGTERM (kvcoll's preemption:
every rank stops after the same step, the checkpoint callback saves, train.py ends as
usual; fit exits 0 there) and reports RSS over time, with the throughput, rows and quick
evaluation of train.py's log lines. Target: after warm-up (the first --soak-warmup of
the run) every rank's RSS stays within 5 % of its value when warm-up ended.

Writes bench/results/soak.json and soak.md.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import common

EXAMPLE = os.path.join(common.ROOT, "examples", "train.py")
KVCOLLRUN = os.path.join(common.ROOT, "launch", "kvcollrun")
TARGET = 0.05


def add_arguments(p) -> None:
    g = p.add_argument_group("soak")
    g.add_argument("--soak-minutes", type=float, default=10.0, help="how long to train")
    g.add_argument("--soak-sample", type=float, default=10.0, help="seconds between RSS samples")
    g.add_argument("--soak-warmup", type=float, default=0.2,
                   help="the first fraction of the run that is warm-up")
    g.add_argument("--soak-world", type=int, default=2, help="ranks")
    g.add_argument("--soak-max-rows", type=int, default=20_000,
                   help="row budget of each table (--max-rows-per-table)")
    g.add_argument("--soak-incremental-every", type=int, default=250,
                   help="steps between incremental checkpoints (a full one every 10)")


def _ranks(root: int) -> list[int]:
    """The Python processes running train.py below `root` (the ranks, not mpirun),
    in pid order."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(
                int(entry))
    out, todo = [], [root]
    while todo:
        for p in children.get(todo.pop(), []):
            todo.append(p)
            try:
                with open(f"/proc/{p}/comm", "rb") as f:
                    python = f.read().startswith(b"python")
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if python and b"train.py" in f.read():
                        out.append(p)
            except OSError:
                pass
    return sorted(out)


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run(args) -> None:
    minutes = 1.0 if args.quick and args.soak_minutes == 10.0 else args.soak_minutes
    sample = min(args.soak_sample, 5.0) if args.quick else args.soak_sample
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    inc = args.soak_incremental_every
    flags = ["--steps", str(10**7), "--no-progress", "--log-every", "100",
             "--eval-samples", "8192", "--admit-min-count", "2", "--evict-after-steps", "500",
             "--max-rows-per-table", str(args.soak_max_rows), "--evict-every", "50",
             "--incremental-every", str(inc), "--checkpoint-every", str(10 * inc)]
    with tempfile.TemporaryDirectory(prefix="kvcoll-soak-") as tmp:
        cmd = [KVCOLLRUN, "-np", str(args.soak_world), sys.executable, EXAMPLE, *flags,
               "--checkpoint-dir", os.path.join(tmp, "ck")]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        print(f"[soak] {minutes:g} min on {args.soak_world} ranks: {' '.join(cmd[3:])}",
              flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=common.ROOT)
        state = {"step": 0, "saves": 0, "tail": [], "log": [], "stopped": None}
        line_rx = re.compile(r"step\s+(\d+)\s+loss\s+(\S+)\s+auc\s+(\S+)\s+([\d,]+) "
                             r"samples/s\s+([\d,]+) rows")

        def read():
            for line in proc.stdout:
                m = line_rx.search(line)
                if m:
                    step = int(m.group(1))
                    state["step"] = max(state["step"], step)
                    state["log"].append({"step": step, "loss": float(m.group(2)),
                                         "auc": float(m.group(3)),
                                         "samples_per_sec": float(m.group(4).replace(",", "")),
                                         "rows": int(m.group(5).replace(",", ""))})
                m = re.search(r"SIGTERM: stopped every rank after step (\d+)", line)
                if m:
                    state["stopped"] = int(m.group(1))
                state["saves"] += "saved" in line and "checkpoint" in line
                state["tail"] = (state["tail"] + [line.rstrip()])[-40:]

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        samples, t0 = [], None
        end = None
        while proc.poll() is None:
            ranks = _ranks(proc.pid)
            if len(ranks) == args.soak_world and t0 is None and state["step"] > 0:
                t0 = time.monotonic()          # training has begun on every rank
                end = t0 + 60 * minutes
            if t0 is not None:
                rss = [_rss_mib(p) for p in ranks]
                if len(ranks) == args.soak_world and None not in rss:
                    samples.append({"t": round(time.monotonic() - t0, 1),
                                    "step": state["step"], "rss_mib": rss})
                if time.monotonic() >= end:
                    break
            time.sleep(sample if t0 is not None else 1.0)
        if proc.poll() is not None:
            raise RuntimeError(f"train.py ended early (exit {proc.returncode}):\n"
                               + "\n".join(state["tail"]))
        for p in _ranks(proc.pid):   # preemption: every rank stops after the same step
            os.kill(p, signal.SIGTERM)
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError("train.py did not end within 600 s of SIGTERM") from None
        reader.join(timeout=5)
        tail = "\n".join(state["tail"])
        if code != 0 or state["stopped"] is None:
            raise RuntimeError(f"train.py did not stop cleanly on SIGTERM (exit {code}):\n{tail}")
    s = summary(samples, args.soak_warmup)
    log = state["log"]
    late = [x for x in log if x["step"] >= samples[0]["step"] + (
        samples[-1]["step"] - samples[0]["step"]) * args.soak_warmup] or log
    s.update(steps=state["stopped"], checkpoints=state["saves"],
             samples_per_sec=sum(x["samples_per_sec"] for x in late) / max(1, len(late)),
             eval_auc=log[-1]["auc"] if log else None,
             table_rows=log[-1]["rows"] if log else None,
             max_table_rows=max((x["rows"] for x in late), default=None),
             row_budget=26 * args.soak_max_rows)
    records = [{"sample": x} for x in samples] + [{"log": x} for x in log] + [{"summary": s}]
    common.publish(out_dir, "soak", records,
                   lambda machine: markdown(samples, s, minutes, args, machine))


def summary(samples: list, warmup: float) -> dict:
    """Per rank: RSS when warm-up ended, the most after it, the growth, the verdict."""
    if len(samples) < 3:
        raise RuntimeError(f"only {len(samples)} RSS samples: run longer")
    t_end = samples[-1]["t"]
    after = [x for x in samples if x["t"] >= warmup * t_end]
    base, growth = [], []
    for r in range(len(samples[0]["rss_mib"])):
        b = after[0]["rss_mib"][r]
        peak = max(x["rss_mib"][r] for x in after)
        base.append(b)
        growth.append((peak - b) / b)
    return {"seconds": t_end, "warmup_seconds": after[0]["t"], "rss_after_warmup_mib": base,
            "rss_peak_after_warmup_mib": [max(x["rss_mib"][r] for x in after)
                                          for r in range(len(base))],
            "rss_end_mib": samples[-1]["rss_mib"], "growth_after_warmup": growth,
            "flat": max(growth) <= TARGET}


def markdown(samples, s, minutes, args, machine) -> str:
    every = max(1, len(samples) // 20)
    shown = samples[::every] + ([samples[-1]] if (len(samples) - 1) % every else [])
    ranks = len(samples[0]["rss_mib"])
    lines = [
        "# Soak: resident memory over a long run", "",
        f"`./dev bench soak` — examples/train.py (DeepFM, 26 tables, synthetic Zipf ids over "
        f"10^7) on {ranks} ranks for {minutes:g} min: `--admit-min-count 2 "
        f"--evict-after-steps 500 --max-rows-per-table {args.soak_max_rows} --evict-every 50 "
        f"--incremental-every {args.soak_incremental_every} --checkpoint-every "
        f"{10 * args.soak_incremental_every}`, stopped by SIGTERM (kvcoll's preemption); "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {machine.get('date', '')}.",
        "",
        "| seconds | step | " + " | ".join(f"rank {r} RSS (MiB)" for r in range(ranks)) + " |",
        "|---:|---:|" + "---:|" * ranks,
    ]
    for x in shown:
        lines.append(f"| {x['t']:.0f} | {x['step']:,} | "
                     + " | ".join(f"{v:,.0f}" for v in x["rss_mib"]) + " |")
    g = ", ".join(f"{100 * v:+.1f} %" for v in s["growth_after_warmup"])
    lines += [
        "",
        f"- {s['steps']:,} steps (stopped by SIGTERM after step {s['steps']:,}), "
        f"{s['samples_per_sec']:,.0f} samples/s after warm-up, quick eval AUC "
        f"{s['eval_auc']:.4f} at the last log line; {s['checkpoints']} checkpoints saved",
        f"- table rows over all ranks after warm-up: at most {s['max_table_rows']:,} at a log "
        f"line (26 tables with a budget of {args.soak_max_rows:,} rows each = "
        f"{s['row_budget']:,}; each table is brought back to its budget every 50 steps, "
        f"rows grow in between), {s['table_rows']:,} at the last one",
        f"- RSS growth after warm-up (the first {s['warmup_seconds']:.0f} s), per rank: {g} "
        f"(peak over the value when warm-up ended; target <= {100 * TARGET:.0f} %): "
        f"{'met' if s['flat'] else '**missed**'}",
        "",
    ]
    return "\n".join(lines)
