"""The two-level exchange against the flat one on three netns hosts of 2 ranks.

    python -m bench topology            # opt-in (makes network-namespace hosts: root)
    python -m bench topology --quick    # a smoke test

Three "hosts" (tests/launch/netns.py: network namespaces joined by veth links, Open MPI
over TCP only, no shared memory), 2 ranks each: 6 ranks on this machine's cores, so
every figure is oversubscribed (6 ranks on 2 cores) and the ratios, not the times, are
the result. Two measurements, each a ratio to a baseline from the same run:

- exchange steps (bench/topology_job.py): in one launch, the same BSP pull + push steps
  over kvcoll's communicator (two-level: 3 hosts x 2) and over a flat one, in turn; per
  phase the messages each rank sent (pull:ids, pull:rows, push:grads), and the seconds
  of a step (the slowest rank's, median over the steps) for each;
- training steps (tests/launch/topology_job.py: the TensorFlow-free BSP job of the
  elastic tests, not pipelined), launched with exchange_topology two-level (set: auto is
  flat below AUTO_TWO_LEVEL_MIN_RANKS; the records still call it "auto") and flat
  in turn, --topology-rounds times: seconds per step after step 50 (rank 0's), and the
  losses of the two, which must be equal.

Writes bench/results/topology.json and topology.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile

from . import common

JOB = os.path.join(common.ROOT, "bench", "topology_job.py")
TRAIN = os.path.join(common.ROOT, "tests", "launch", "topology_job.py")
PHASES = ("pull:ids", "pull:rows", "push:grads")


def add_arguments(p) -> None:
    g = p.add_argument_group("topology")
    g.add_argument("--topology-steps", type=int, default=300,
                   help="exchange steps per communicator (the first 20 are not timed)")
    g.add_argument("--topology-train-steps", type=int, default=150,
                   help="training steps per launch (timed from step 50)")
    g.add_argument("--topology-rounds", type=int, default=3,
                   help="launches of each training topology, alternating")
    g.add_argument("--topology-timeout", type=float, default=900.0)


def _records(out: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"@@record (\{.*\})", out)]


def exchange_steps(hosts, args, steps: int) -> dict:
    code, out = _run(hosts, ["-np", 6, sys.executable, JOB, "--steps", steps,
                             "--warmup", min(20, steps // 4)], args, "exchange steps",
                     {"KVCOLL_EXCHANGE_TOPOLOGY": "two-level"})   # auto: flat at 6 ranks
    rec = _records(out)
    if code != 0 or not rec:
        raise SystemExit(f"[topology] the exchange job failed (exit {code}):\n{out[-4000:]}")
    rec = rec[0]
    ranks = rec.pop("ranks")
    per = {}
    for name in ("kvcoll", "flat"):
        n = len(ranks[0]["secs"][name]["pull"])
        step = [max(r["secs"][name]["pull"][i] + r["secs"][name]["push"][i] for r in ranks)
                for i in range(n)]
        pull = [max(r["secs"][name]["pull"][i] for r in ranks) for i in range(n)]
        push = [max(r["secs"][name]["push"][i] for r in ranks) for i in range(n)]
        per[name] = {
            "step_ms": 1e3 * statistics.median(step), "pull_ms": 1e3 * statistics.median(pull),
            "push_ms": 1e3 * statistics.median(push),
            # messages a rank sent per step and phase (the mean over ranks)
            "messages": {ph: statistics.mean(r["msgs"][name][ph] for r in ranks) / n
                         for ph in PHASES}}
    rec.update(kind="exchange", **per,
               ratio_step=per["kvcoll"]["step_ms"] / per["flat"]["step_ms"],
               ratio_pull=per["kvcoll"]["pull_ms"] / per["flat"]["pull_ms"],
               ratio_push=per["kvcoll"]["push_ms"] / per["flat"]["push_ms"])
    return rec


def training_steps(hosts, args, steps: int, rounds: int, tmp: str) -> dict:
    per = {"auto": [], "flat": []}
    tops, losses = {}, {}
    for i in range(rounds):
        for topo in (("auto", "flat") if i % 2 == 0 else ("flat", "auto")):
            path = os.path.join(tmp, f"losses-{topo}-{i}.json")
            code, out = _run(hosts, ["-np", 6, sys.executable, TRAIN, "--steps", steps,
                                     "--batch-size", 1200, "--losses", path], args,
                             f"training, {topo}",    # "auto" is two-level set (auto: flat
                             {"KVCOLL_EXCHANGE_TOPOLOGY":    # below AUTO_TWO_LEVEL_MIN_RANKS)
                              "two-level" if topo == "auto" else topo})
            m = re.search(r"seconds per step ([0-9.]+)", out)
            if code != 0 or m is None:
                raise SystemExit(f"[topology] the training job ({topo}) failed (exit {code}):"
                                 f"\n{out[-4000:]}")
            per[topo].append(float(m.group(1)))
            tops[topo] = sorted({json.loads(t)["mode"] for t in
                                 re.findall(r"TOPOLOGY (\{.*\})", out)})
            with open(path) as f:
                losses.setdefault(topo, json.load(f))
    ratios = [a / b for a, b in zip(per["auto"], per["flat"])]
    return {"kind": "training", "steps_timed": steps - 50, "rounds": rounds,
            "seconds_per_step": per, "modes": tops,
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "losses_equal": losses["auto"] == losses["flat"]}


def _run(hosts, argv, args, what, env=None):
    return hosts.run(argv, args.topology_timeout, what, env_extra=env)


def markdown(records, machine, command) -> str:
    ex = next(r for r in records if r["kind"] == "exchange")
    tr = next((r for r in records if r["kind"] == "training"), None)
    shape = "x".join(map(str, ex["topology"]["shape"]))
    lines = [
        "# Two-level exchange vs flat (3 netns hosts x 2 ranks)", "",
        (f"`{command}` on {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores): six "
        "ranks on three network-namespace hosts (tests/launch/netns.py; Open MPI over TCP "
        "only, no shared memory), i.e. **oversubscribed** (6 ranks on 2 cores): the ratios "
        "are the result, measured in the same run; the times are not what hosts of their own "
        "would see."), "",
        (f"kvcoll's communicator: **{ex['topology']['mode']}** ({shape}: "
        f"{ex['topology']['why']})."), "",
        "## Exchange steps (bench/topology_job.py)", "",
        (f"{ex['steps']} BSP steps per communicator, taken in turn, {ex['batch_size']} ids per "
        "table per rank, two tables of dim 16. Tables equal bit for bit at the end: "
        f"**{ex['tables_equal']}**."), "",
        "| | flat | two-level | ratio |", "|---|---:|---:|---:|"]
    for ph in PHASES:
        a, b = ex["flat"]["messages"][ph], ex["kvcoll"]["messages"][ph]
        lines.append(f"| messages a rank sends per step, {ph} | {a:.2f} | {b:.2f} | "
                     f"{b / a:.2f} |")
    for key, label in (("pull_ms", "pull (ids + rows), ms"), ("push_ms", ("push (gradients, "
                       "allreduce, apply), ms")), ("step_ms", "step, ms (slowest rank, median)")):
        a, b = ex["flat"][key], ex["kvcoll"][key]
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    if tr is not None:
        a = statistics.median(tr["seconds_per_step"]["flat"]) * 1e3
        b = statistics.median(tr["seconds_per_step"]["auto"]) * 1e3
        lines += [
            "", "## Training steps (tests/launch/topology_job.py: BSP, TF-free)", "",
            (f"{tr['rounds']} launches each, alternating; {tr['steps_timed']} timed steps per "
            f"launch. Modes seen: auto {tr['modes'].get('auto')}, flat "
            f"{tr['modes'].get('flat')}. Losses equal: **{tr['losses_equal']}**."), "",
            "| | flat | auto (two-level) | ratio (median of per-round ratios) |",
            "|---|---:|---:|---:|",
            (f"| ms per step (median of launches) | {a:.2f} | {b:.2f} | "
            f"{tr['ratio_median']:.2f} |")]
    return "\n".join(lines) + "\n"


def run(args) -> None:
    sys.path.insert(0, os.path.join(common.ROOT, "tests", "launch"))
    import netns

    quick = args.quick
    steps = 40 if quick else args.topology_steps
    train_steps = 70 if quick else args.topology_train_steps
    rounds = 1 if quick else args.topology_rounds
    out_dir = args.out or (tempfile.mkdtemp() if quick else common.RESULTS)
    reason = netns.Hosts.unavailable()
    if reason:
        raise SystemExit(f"[topology] cannot make the test hosts: {reason}")
    command = "./dev bench topology" + (" --quick" if quick else "")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = netns.Hosts.create(3, os.path.join(tmp, "hosts"), slots=[2, 2, 2])
        try:
            records.append(exchange_steps(hosts, args, steps))
            records.append(training_steps(hosts, args, train_steps, rounds, tmp))
        finally:
            hosts.close()
    common.publish(out_dir, "topology", records, lambda m: markdown(records, m, command))
