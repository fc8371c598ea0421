"""The scale model, measured and checked: samples/s per rank from 1 to 1,024 ranks.

    python -m bench scale            # opt-in (makes network-namespace hosts: root)
    python -m bench scale --quick    # a smoke test (about 30 s: 3 netns hosts, one check,
                                     # no DeepFM; the curves use the numpy job's workload)

1. Measured inputs (bench/scale_job.py):
   - this MPI between two ranks, over shared memory (one host) and over TCP between two
     netns hosts (tests/launch/netns.py): a message's cost, a stage's latency (raw
     ping-pong of k messages, and kvcoll's own all-to-all stage) and the bandwidth;
   - the step's phases (kvcoll.step.Loop's own timers: exchange, tables, compute,
     allreduce, apply) of a TensorFlow-free job (a numpy MLP on 8 fields of one table) on
     1 rank and on 2 ranks (two netns hosts);
   - DeepFM's phases (bench/train_worker.py --impl kvcoll, the train bench's model, one
     TensorFlow thread a rank) on 1 and 2 ranks of this machine: the workload of the
     large-scale curves.
   - the scheduler's hand-off: the same 2-rank step while busy processes (cores - 1 of
     them) make the ranks share the cores, as 3 to 6 ranks do below: what each
     collective then waits beyond the model's stretched latency.
2. The model (bench/scale_model.py), calibrated on those 1- and 2-rank runs alone,
   predicts the numpy job on 3, 4 and 6 ranks over netns hosts (3x1, 2x2, 4x1, 3x2, 6x1;
   flat and two-level where hosts hold 2 ranks), oversubscribed (ranks / cores > 1: the
   CPU-share term); each is then run and compared (target: within 20%).
3. It predicts DeepFM's samples/s per rank for P = 1 ... 1,024 (hosts of 8 ranks), flat
   vs two-level, fp32 vs fp16 rows, on 10, 25 and 100 Gb/s TCP, and the world size from
   which two-level beats flat on the measured TCP figures (kvcoll._topology's
   AUTO_TWO_LEVEL_MIN_RANKS).

Writes bench/results/scale.json, scale.md and scale.png.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

from . import common
from . import scale_model as sm

JOB = os.path.join(common.ROOT, "bench", "scale_job.py")
WORKER = os.path.join(common.ROOT, "bench", "train_worker.py")
NETWORKS_GBIT = (10, 25, 100)
# A real network's latency per all-to-all stage beyond what the netns hosts measure (the
# kernel's TCP stack and kvcoll's wait are measured there; a veth has no wire, NIC or
# switch): 20 us, issue #32's figure for TCP ("about 20 us a message"), typical of kernel
# TCP over 10-100 GbE (a switch hop, the NIC's interrupt moderation and both stacks).
WIRE_LATENCY_S = 20e-6
PER_HOST = 8          # ranks per host of the large-scale curves (64 hosts of 32 cores: 4
#                       cores a rank)
CHECKS = ((3, 1, "flat"), (2, 2, "flat"), (2, 2, "two-level"), (4, 1, "flat"),
          (3, 2, "flat"), (3, 2, "two-level"), (6, 1, "flat"))


def add_arguments(p) -> None:
    g = p.add_argument_group("scale")
    g.add_argument("--scale-steps", type=int, default=200, help="timed steps per launch")
    g.add_argument("--scale-warmup", type=int, default=30)
    g.add_argument("--scale-batch", type=int, default=2048, help="samples per rank a step")
    g.add_argument("--scale-deepfm-steps", type=int, default=60,
                   help="DeepFM steps on 1 and 2 ranks (0: skip; the curves then use the "
                   "numpy job's workload)")
    g.add_argument("--scale-deepfm-rounds", type=int, default=3,
                   help="rounds of a 1-rank and a 2-rank DeepFM launch: each phase is the "
                   "median over them (the multi-rank step's own CPU and waits, the "
                   "difference of two runs' figures, moved 2x between single launches)")
    g.add_argument("--scale-handoff-rounds", type=int, default=3,
                   help="2-rank launches beside busy processes that measure the scheduler's "
                   "hand-off (the median counts)")
    g.add_argument("--scale-timeout", type=float, default=900.0)
    g.add_argument("--scale-quiet-wait", type=float, default=30.0,
                   help="seconds to wait before each launch for the other processes to use "
                   "less than 0.3 cores (the machine is shared)")


def _records(out: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"@@record (\{.*\})", out)]


def _mpirun_local(n: int, argv: list, timeout: float, what: str) -> str:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(n), sys.executable,
           *map(str, argv)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=common.ROOT, KVCOLL_EXCHANGE_TOPOLOGY="flat")
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True,
                          cwd=common.ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"[scale] {what} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _one(out: str, what: str) -> dict:
    rec = _records(out)
    if not rec:
        raise SystemExit(f"[scale] {what}: no record in its output:\n{out[-3000:]}")
    return rec[0]


def _on_hosts(hosts, n_hosts: int, per_host: int, argv: list, args, what: str,
              topology: str = "flat") -> str:
    hf = hosts.hostfile_for(range(n_hosts), [per_host] * n_hosts)
    for attempt in range(3):
        code, out = hosts.run(["-np", n_hosts * per_host, sys.executable, JOB, *argv],
                              args.scale_timeout, what,
                              env_extra={"KVCOLL_EXCHANGE_TOPOLOGY": topology}, hostfile=hf)
        # PRRTE's daemon on a netns host did not report back in time (a loaded machine):
        # nothing of the job ran, so it is launched again
        if code == 0 or "failed to report back" not in out or attempt == 2:
            break
        print(f"[scale] {what}: a daemon did not start (exit {code}); launching again",
              flush=True)
    if code != 0:
        raise SystemExit(f"[scale] {what} failed (exit {code}):\n{out[-4000:]}")
    return out


# -- turning records into model inputs -------------------------------------------------------

def link_of(net: dict, name: str) -> sm.Link:
    """A link from a net record (both ranks' figures, averaged)."""
    r = net["ranks"]
    return sm.Link(name, statistics.mean(x["kv_stage_s"] for x in r),
                   statistics.mean(x["raw_message_s"] for x in r),
                   statistics.mean(x["kv_bandwidth"] for x in r))


def step_summary(rec: dict) -> dict:
    """A step record's per-rank means: seconds per step by phase, wall, messages, ids."""
    ranks = rec["ranks"]
    ph = {k: statistics.mean(r["timings_s"].get(k, 0.0) for r in ranks)
          for k in ("exchange", "compute", "allreduce", "apply", "stage_wait")}
    return {"phases_s": ph, "tables_s": statistics.mean(r["tables_s"] for r in ranks),
            "wall_s": statistics.mean(r["wall_s"] for r in ranks),
            "unique_ids": statistics.mean(r["unique_ids"] for r in ranks),
            "messages": {k: statistics.mean(r["messages"].get(k, 0) for r in ranks)
                         for k in sorted({k for r in ranks for k in r["messages"]})},
            "wire_bytes": {k: statistics.mean(r["wire_bytes"][k] for r in ranks)
                           for k in ("ids", "rows", "grads")},
            # what other processes used during the timed steps: the machine's busy cores
            # less this job's ranks' own
            "others_cores": max(0.0, statistics.mean(r["machine_busy_cores"] for r in ranks)
                                - sum(r["cpu_s"] / r["wall_s"] for r in ranks))}


def share(cores: int, ranks: int, others: float = 0.0) -> float:
    """A rank's share of a core: the cores the other processes left (they used `others`
    of the machine's `cores`, as measured), split evenly over `ranks` ranks; 1 when they
    fit. (Not cores / (ranks + others), a fair share that counts the others as ranks:
    the others here are multi-threaded TensorFlow jobs that take what they use, and that
    form undercorrected a calibration run during which they used 1.2 cores.)"""
    return min(1.0, max(cores - others, 0.1 * cores) / ranks)


def corunners(cores: int, ranks: int, others: float = 0.0) -> int:
    """The other tasks that share the slowest rank's core: the ranks and the other
    processes' busy cores (rounded: whole processes) spread over the cores, less the rank
    itself; 0 when they fit."""
    return max(0, math.ceil((ranks + round(others)) / cores) - 1)


@contextlib.contextmanager
def busy_processes(n: int):
    """n processes that keep a core busy each (a Python loop) until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def handoff_of(summary: dict, w: sm.Workload, tcp: sm.Link, cores: int, busy: int) -> dict:
    """The scheduler's hand-off from a 2-rank run (2 netns hosts x 1) beside `busy` busy
    processes: what its collectives (not its compute) took beyond the model's terms at
    its CPU share, per collective and per co-runner."""
    s = share(cores, 2, summary["others_cores"])
    k = max(1, corunners(cores, 2, busy))
    st = sm.step_seconds(w, sm.Cluster(2, 1, tcp, tcp, cpu_share=s), "flat")
    ph = summary["phases_s"]
    measured_rest = measured_step_s(summary) - ph["compute"]
    predicted_rest = st.total - w.compute_s / s
    n = sm.collectives(2, 1, "flat")
    return {"cpu_share": s, "corunners": k, "collectives": n,
            "measured_rest_s": measured_rest, "predicted_rest_s": predicted_rest,
            "measured_compute_s": ph["compute"], "predicted_compute_s": w.compute_s / s,
            "others_cores": summary["others_cores"],
            "handoff_s": max(0.0, (measured_rest - predicted_rest) / (n * k))}


def workload_of(one: dict, two: dict, rec: dict, two_cluster: sm.Cluster,
                ids_per_sample: float, dim: float, n_dense: int, cores: int) -> sm.Workload:
    """The model's workload from a 1-rank and a 2-rank summary (step_summary), each
    brought to a core of its own (x its CPU share, from the other processes' measured
    use): the CPU terms from the 2-rank run (both cores busy, as in every larger run),
    the exchange's own CPU from the 1-rank run, and multi_s = what the 2-rank exchange
    and allreduce took beyond its tables, that CPU and the model's messages and bytes on
    its link."""
    p1, p2 = one["phases_s"], two["phases_s"]
    s1, s2 = share(cores, 1, one["others_cores"]), share(cores, 2, two["others_cores"])
    base = sm.Workload(
        batch=rec["batch"], ids_per_sample=ids_per_sample,
        unique_frac=one["unique_ids"] / (rec["batch"] * ids_per_sample), dim=dim,
        n_dense=n_dense, compute_s=p2["compute"] * s2, tables_s=two["tables_s"] * s2,
        plan_s=max(p1["exchange"] - one["tables_s"], 0.0) * s1,
        apply_s=(p2["apply"] + p2["stage_wait"]) * s2)
    comm = sm.step_seconds(base, two_cluster, "flat")
    modelled = comm.latency + comm.bytes + comm.allreduce
    multi = max((p2["exchange"] - two["tables_s"] + p2["allreduce"]) * s2 - base.plan_s
                - modelled, 0.0)
    return sm.Workload(**{**base.__dict__, "multi_s": multi})


def measured_step_s(summary: dict) -> float:
    """A measured run's seconds per step: its phases (the loop's timers), summed."""
    return sum(summary["phases_s"].values())


def deepfm(args, quick: bool, tmp: str) -> list[dict] | None:
    """DeepFM's phases on 1 and 2 ranks of this machine (bench/train_worker.py), in
    --scale-deepfm-rounds rounds of a 1-rank and a 2-rank launch each: [{1: record,
    2: record, "busy": {1: cores, 2: cores}}] (busy: what the other processes used just
    before each launch)."""
    steps = 0 if quick else args.scale_deepfm_steps    # --quick: no TensorFlow
    if steps <= 0:
        return None
    rounds = []
    for r in range(max(args.scale_deepfm_rounds, 1)):
        out = {"busy": {}}
        for world in (1, 2):
            path = os.path.join(tmp, f"deepfm-{r}-{world}.json")
            out["busy"][world] = common.wait_until_quiet(5 if quick else 120, below=0.3)
            _mpirun_local(world, [WORKER, "--impl", "kvcoll", "--steps", steps, "--warmup", 10,
                                  "--batch-size", 4096 * world, "--threads", 1, "--out", path,
                                  "--eval-samples", 4096],
                          args.scale_timeout, f"DeepFM on {world} rank(s)")
            with open(path) as f:
                out[world] = json.load(f)
        rounds.append(out)
    return rounds


def deepfm_unique_frac(batch: int = 4096, steps: int = 3) -> float:
    """Unique ids / ids of a 4096-sample synthetic batch (per field, as the tables key)."""
    import numpy as np

    from kvcoll.data import SyntheticCTR
    data = SyntheticCTR(seed=0, vocab=10**7)
    fr = []
    for s in range(steps):
        cat = data.batch(s, batch)["categorical"]
        fr.append(sum(np.unique(cat[:, f]).size for f in range(cat.shape[1])) / cat.size)
    return statistics.mean(fr)


def deepfm_phases(rounds: list[dict], cores: int) -> tuple[dict, dict]:
    """The median over rounds of each phase (ms a step) on 1 and on 2 ranks, each launch
    brought to a core of its own with the CPU the other processes used just before."""
    def median(world):
        runs = [{k: v * share(cores, world, r["busy"][world])
                 for k, v in r[world]["ms_per_step"].items()} for r in rounds]
        return {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    return median(1), median(2)


def deepfm_workload(one: dict, two: dict, shm: sm.Link, unique_frac: float) -> sm.Workload:
    """The DeepFM workload (26 fields, dim 8 + 1 first-order weight a row, MLP 256-128
    on 26 x 8 + 13 inputs) from its phases on 1 and 2 ranks (ms a step, each brought to
    a core of its own; 2 ranks: one host, shm)."""
    dim = 9
    n_dense = (26 * 8 + 13) * 256 + 256 + 256 * 128 + 128 + 128 + 1 + 13 + 1
    base = sm.Workload(batch=4096, ids_per_sample=26, unique_frac=unique_frac, dim=dim,
                       n_dense=n_dense, compute_s=two["compute"] / 1e3,
                       tables_s=two["tables"] / 1e3,
                       plan_s=max(one["exchange"] - one["tables"], 0.0) / 1e3,
                       apply_s=two["apply"] / 1e3)
    c2 = sm.Cluster(2, 2, shm, shm)
    st = sm.step_seconds(base, c2, "flat")
    multi = max((two["exchange"] - two["tables"] + two["allreduce"]) / 1e3 - base.plan_s
                - (st.latency + st.bytes + st.allreduce), 0.0)
    return sm.Workload(**{**base.__dict__, "multi_s": multi})


# -- the curves --------------------------------------------------------------------------------

RANKS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)


def real_links(shm: sm.Link, tcp: sm.Link, gbit: float) -> tuple[sm.Link, sm.Link]:
    inter = sm.Link(f"TCP {gbit:g} Gb/s", tcp.stage_s + WIRE_LATENCY_S, tcp.message_s,
                    gbit * sm.GBIT)
    return shm, inter


def curves(w: sm.Workload, shm: sm.Link, tcp: sm.Link, pipelined: bool = True) -> list[dict]:
    out = []
    for gbit in NETWORKS_GBIT:
        intra, inter = real_links(shm, tcp, gbit)
        for topo in ("flat", "two-level"):
            for wire, nbytes in (("fp32", 4), ("fp16", 2)):
                pts = []
                for P in RANKS:
                    L = min(PER_HOST, P)
                    c = sm.Cluster(P, L, intra, inter)
                    st = sm.step_seconds(w, c, topo, nbytes, pipelined)
                    pts.append({"ranks": P, "efficiency": sm.efficiency(w, c, topo, nbytes,
                                                                        pipelined),
                                "samples_per_sec_per_rank": w.batch / st.total,
                                "step_ms": st.total * 1e3,
                                "parts_ms": {k: v * 1e3 for k, v in st.parts.items()}})
                out.append({"network_gbit": gbit, "topology": topo, "wire": wire,
                            "points": pts})
    return out


def limits(w: sm.Workload, shm: sm.Link, tcp: sm.Link, gbit: float = 25) -> dict:
    """At 256 and 1,024 ranks, two-level + fp16, pipelined: each term's ms."""
    intra, inter = real_links(shm, tcp, gbit)
    out = {}
    for P in (256, 1024):
        st = sm.step_seconds(w, sm.Cluster(P, PER_HOST, intra, inter), "two-level", 2, True)
        out[P] = {"step_ms": st.total * 1e3, "cpu_ms": st.cpu * 1e3,
                  "latency_ms": st.latency * 1e3, "bytes_ms": st.bytes * 1e3,
                  "allreduce_ms": st.allreduce * 1e3, "overlap_ms": st.overlap * 1e3}
    # with a stated 20 us per message (the issue's framing) instead of per stage
    slow = sm.Link("TCP, 20 us a message", tcp.stage_s, tcp.message_s + WIRE_LATENCY_S,
                   gbit * sm.GBIT)
    out["per_message_20us"] = {P: sm.efficiency(w, sm.Cluster(P, PER_HOST, shm, slow),
                                                "two-level", 2, True) for P in (256, 1024)}
    out["flat_per_message_20us"] = {P: sm.efficiency(w, sm.Cluster(P, PER_HOST, shm, slow),
                                                     "flat", 2, True) for P in (256, 1024)}
    return out


def plot(cur: list[dict], checks: list[dict], path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(NETWORKS_GBIT) + 1, figsize=(16, 4))
    for ax, gbit in zip(axes, NETWORKS_GBIT):
        for c in cur:
            if c["network_gbit"] != gbit:
                continue
            xs = [p["ranks"] for p in c["points"]]
            ys = [100 * p["efficiency"] for p in c["points"]]
            ax.plot(xs, ys, "-" if c["topology"] == "two-level" else "--",
                    marker="o" if c["wire"] == "fp16" else "x", ms=4,
                    label=f"{c['topology']}, {c['wire']}")
        ax.axhline(80, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(f"DeepFM, {gbit} Gb/s TCP, {PER_HOST} ranks a host", fontsize=9)
        ax.set_xlabel("ranks")
        ax.set_ylabel("per-rank efficiency, % (predicted)")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for ch in checks:
        ax.plot(ch["predicted_ms"], ch["measured_ms"], "o" if ch["topology"] == "flat" else "s")
        ax.annotate(ch["label"], (ch["predicted_ms"], ch["measured_ms"]), fontsize=7)
    hi = max([1.0] + [max(c["predicted_ms"], c["measured_ms"]) for c in checks]) * 1.1
    ax.plot([0, hi], [0, hi], "k-", lw=0.5)
    ax.plot([0, hi], [0, 1.2 * hi], "k:", lw=0.5)
    ax.plot([0, hi], [0, hi / 1.2], "k:", lw=0.5)
    ax.set_title("netns hosts: measured vs predicted (±20%)", fontsize=9)
    ax.set_xlabel("predicted ms a step")
    ax.set_ylabel("measured ms a step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


# -- the run -------------------------------------------------------------------------------------

def run(args) -> None:
    sys.path.insert(0, os.path.join(common.ROOT, "tests", "launch"))
    import netns

    quick = args.quick
    steps = 20 if quick else args.scale_steps
    warm = 5 if quick else args.scale_warmup
    out_dir = args.out or (tempfile.mkdtemp() if quick else common.RESULTS)
    reason = netns.Hosts.unavailable()
    if reason:
        raise SystemExit(f"[scale] cannot make the test hosts: {reason}")
    cores = os.cpu_count() or 1
    quiet_wait = 0 if quick else args.scale_quiet_wait
    job = ["--mode", "step", "--steps", steps, "--warmup", warm, "--batch", args.scale_batch]
    reps = ["--reps", 300 if quick else 2000]
    busy = {}
    records: dict = {"kind": "scale", "cores": cores, "per_host_curves": PER_HOST,
                     "wire_latency_s": WIRE_LATENCY_S}
    with tempfile.TemporaryDirectory() as tmp:
        busy["net:shm"] = common.wait_until_quiet(quiet_wait, below=0.3)
        shm_rec = _one(_mpirun_local(2, [JOB, "--mode", "net", *reps], args.scale_timeout,
                                     "net, shared memory"), "net, shared memory")
        busy["step:1"] = common.wait_until_quiet(quiet_wait, below=0.3)
        one_rec = _one(_mpirun_local(1, [JOB, *job], args.scale_timeout, "step, 1 rank"),
                       "step, 1 rank")
        checks = CHECKS[:1] if quick else CHECKS      # --quick: 3 hosts x 1 alone
        hosts = netns.Hosts.create(3 if quick else 6, os.path.join(tmp, "hosts"),
                                   slots=[2] * (3 if quick else 6))
        runs = {}
        try:
            busy["net:tcp"] = common.wait_until_quiet(quiet_wait, below=0.3)
            tcp_rec = _one(_on_hosts(hosts, 2, 1, ["--mode", "net", *reps], args,
                                     "net, TCP"), "net, TCP")
            busy["step:2"] = common.wait_until_quiet(quiet_wait, below=0.3)
            two_rec = _one(_on_hosts(hosts, 2, 1, job, args, "step, 2 hosts x 1"),
                           "step, 2 ranks")
            hand_recs = []
            for i in range(1 if quick else max(args.scale_handoff_rounds, 1)):
                busy[f"handoff:{i}"] = common.wait_until_quiet(quiet_wait, below=0.3)
                with busy_processes(cores - 1):
                    hand_recs.append(_one(_on_hosts(hosts, 2, 1, job, args,
                                                    "step, 2 hosts x 1 beside busy processes"),
                                          "hand-off"))
            for H, L, topo in checks:
                key = f"{H}x{L} {topo}"
                busy[key] = common.wait_until_quiet(quiet_wait, below=0.3)
                runs[key] = _one(_on_hosts(hosts, H, L, job, args, f"step, {key}", topo),
                                 key)
        finally:
            hosts.close()
        busy["deepfm"] = common.busy_cores()
        dfm = deepfm(args, quick, tmp)

    shm, tcp = link_of(shm_rec, "shared memory"), link_of(tcp_rec, "netns TCP")
    one, two = step_summary(one_rec), step_summary(two_rec)
    c2 = sm.Cluster(2, 1, tcp, tcp)
    w = workload_of(one, two, two_rec, c2, two_rec["fields"], two_rec["dim"],
                    two_rec["n_dense"], cores)
    hand = [handoff_of(step_summary(r), w, tcp, cores, cores - 1) for r in hand_recs]
    handoff = statistics.median(h["handoff_s"] for h in hand)
    results = []
    for (H, L, topo) in checks:
        key = f"{H}x{L} {topo}"
        s = step_summary(runs[key])
        P = H * L
        # netns hosts have no shared memory (btl tcp,self): inside a host is TCP too
        c = sm.Cluster(P, L, tcp, tcp, cpu_share=share(cores, P, s["others_cores"]),
                       corunners=corunners(cores, P, s["others_cores"]), handoff_s=handoff)
        st = sm.step_seconds(w, c, topo)
        bare = sm.step_seconds(w, dataclasses.replace(c, handoff_s=0.0), topo)
        meas = measured_step_s(s)
        results.append({"label": key, "hosts": H, "per_host": L, "ranks": P,
                       "topology": topo, "mode_seen": runs[key]["topology"]["mode"],
                       "cpu_share": c.cpu_share, "corunners": c.corunners,
                       "predicted_ms": st.total * 1e3, "handoffs_ms": st.handoffs * 1e3,
                       "measured_ms": meas * 1e3, "measured_wall_ms": s["wall_s"] * 1e3,
                       "ratio": meas / st.total, "predicted_bare_ms": bare.total * 1e3,
                       "ratio_bare": meas / bare.total,
                       "others_cores": s["others_cores"],
                       "predicted_parts_ms": {k: v * 1e3 for k, v in st.parts.items()},
                       "measured_phases_ms": {k: v * 1e3 for k, v in s["phases_s"].items()},
                       "measured_tables_ms": s["tables_s"] * 1e3,
                       "messages_per_step": s["messages"],
                       "model_messages": sm.messages(P, L, topo),
                       "others_busy_cores": busy[key]})
    dfm_rec = None
    if dfm is not None:
        frac = deepfm_unique_frac()
        one_d, two_d = deepfm_phases(dfm, cores)
        wd = deepfm_workload(one_d, two_d, shm, frac)
        per_round = []
        at_256 = sm.Cluster(256, PER_HOST, *real_links(shm, tcp, 25))
        for rnd in dfm:          # each round's own workload: how far multi_s moves
            o, t = deepfm_phases([rnd], cores)
            w_round = deepfm_workload(o, t, shm, frac)
            per_round.append({"one": o, "two": t, "busy": rnd["busy"],
                              "workload": w_round.__dict__,
                              "efficiency_256": sm.efficiency(w_round, at_256, "two-level",
                                                              2, True)})
        dfm_rec = {"one": one_d, "two": two_d, "rounds": per_round, "unique_frac": frac,
                   "workload": wd.__dict__}
    else:
        frac, wd = None, w
    cur = curves(wd, shm, tcp)
    lim = limits(wd, shm, tcp)
    thr = sm.two_level_threshold(wd, shm, tcp)
    thr_numpy = sm.two_level_threshold(w, shm, tcp)
    records.update({
        "links": {"shm": shm.__dict__, "netns_tcp": tcp.__dict__},
        "net": {"shm": shm_rec, "tcp": tcp_rec},
        "calibration": {"one": one, "two": two, "workload": w.__dict__},
        "handoff": {"busy_processes": cores - 1, "rounds": hand, "handoff_s": handoff},
        "checks": results, "others_busy_cores": busy,
        "deepfm": dfm_rec,
        "curves": cur, "limits": lim,
        "two_level_threshold": {"deepfm": thr, "numpy_job": thr_numpy},
        "quick": quick})
    png = os.path.join(out_dir, "scale.png")
    os.makedirs(out_dir, exist_ok=True)
    drawn = plot(cur, results, png)
    command = "./dev bench scale" + (" --quick" if quick else "")
    common.publish(out_dir, "scale", [records],
                   lambda m: markdown(records, m, command, drawn))


def _eff(cur, gbit, topo, wire, P):
    for c in cur:
        if (c["network_gbit"], c["topology"], c["wire"]) == (gbit, topo, wire):
            return next(p for p in c["points"] if p["ranks"] == P)
    raise KeyError((gbit, topo, wire, P))


def markdown(r: dict, machine: dict, command: str, png: str | None) -> str:
    shm, tcp = r["links"]["shm"], r["links"]["netns_tcp"]
    cal = r["calibration"]
    w = cal["workload"]
    lines = [
        "# How far it scales: the scale model, measured and checked", "",
        (f"`{command}` on {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores), "
         f"{machine.get('date', '?')}. The machine is shared: other sessions were running "
         "(each launch waited up to --scale-quiet-wait seconds for them to quiet down). The "
         "CPU the other processes used during each run's timed steps (the machine's busy "
         "cores from /proc/stat less the job's ranks' own CPU), and just before it, is in "
         "the tables; the model's CPU share counts it. Model: bench/scale_model.py; "
         "driver: bench/scale_bench.py."), "",
        "## Measured inputs", "",
        ("| link | a stage's latency (kvcoll all-to-all, 1 message) | a message's cost "
        "(raw MPI, slope of k-message ping-pong) | bandwidth (kvcoll, 8 MiB) |"),
        "|---|---:|---:|---:|"]
    for name, lk in (("shared memory (2 ranks, one host)", shm),
                     ("TCP between 2 netns hosts", tcp)):
        lines.append(f"| {name} | {lk['stage_s'] * 1e6:.1f} us | {lk['message_s'] * 1e6:.2f} us "
                     f"| {lk['bandwidth'] / 1e9:.2f} GB/s |")
    one, two = cal["one"], cal["two"]
    lines += [
        "", ("Step phases of the numpy job (kvcoll.step.Loop's timers, ms a step; batch "
             f"{w['batch']} a rank, 8 fields, dim 16, MLP 512; 1 rank, "
             "and 2 ranks on two netns hosts):"), "",
        ("| | exchange | of it, tables | compute | allreduce | apply | wall | others' CPU "
        "during |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in (("1 rank", one), ("2 ranks (TCP)", two)):
        p = s["phases_s"]
        lines.append(f"| {name} | {p['exchange'] * 1e3:.2f} | {s['tables_s'] * 1e3:.2f} | "
                     f"{p['compute'] * 1e3:.2f} | {p['allreduce'] * 1e3:.2f} | "
                     f"{p['apply'] * 1e3:.2f} | {s['wall_s'] * 1e3:.2f} | "
                     f"{s['others_cores']:.2f} |")
    lines += ["", ("Each run's figures are brought to a core of its own by its CPU share, "
                   "min(1, (cores - the others' cores) / ranks); model workload (s): "
                   + ", ".join(
        f"{k} {v:.4g}" for k, v in w.items())), ""]
    hd = r.get("handoff")
    if hd:
        lines += [
            ("The scheduler's hand-off, measured on 2 ranks (two netns hosts x 1) while "
             f"{hd['busy_processes']} busy process(es) (a Python loop each) made them share "
             "the cores: each collective of a BSP step ends only when its slowest rank has "
             "been back on a core, which takes the scheduler milliseconds. What the run's "
             "collectives (exchange, allreduce, apply: not its compute) took beyond the "
             "model's terms at its CPU share, per collective and per co-runner:"), "",
            ("| round | others' CPU during | CPU share | compute, measured / predicted ms | "
             "the rest, measured / predicted ms | collectives x co-runners | hand-off ms |"),
            "|---:|---:|---:|---:|---:|---:|---:|"]
        for i, h in enumerate(hd["rounds"], 1):
            lines.append(
                f"| {i} | {h['others_cores']:.2f} | {h['cpu_share']:.2f} | "
                f"{h['measured_compute_s'] * 1e3:.1f} / {h['predicted_compute_s'] * 1e3:.1f} | "
                f"{h['measured_rest_s'] * 1e3:.1f} / {h['predicted_rest_s'] * 1e3:.1f} | "
                f"{h['collectives']:g} x {h['corunners']} | {h['handoff_s'] * 1e3:.2f} |")
        lines += ["", (f"The model takes the median, **{hd['handoff_s'] * 1e3:.2f} ms** a "
                       "collective per co-runner."), ""]
    checks = r["checks"]
    lines += [
        "## Predicted vs measured: 3 to 6 ranks on netns hosts", "",
        ("Calibrated on the 1- and 2-rank runs above only. The netns hosts run on this "
         f"machine's {r['cores']} cores, so each of P ranks gets a CPU share of "
         "min(1, (cores - the others' cores) / P), and the slowest rank shares its core "
         "with ceil((P + the others' cores, rounded) / cores) - 1 co-runners: each "
         "collective of the step (every all-to-all stage, and the allreduce) waits the "
         "measured hand-off per co-runner, times the fraction of the other ranks it "
         "exchanges with (1 for a flat stage and the allreduce; a two-level stage talks "
         "to the ranks of its host, or to those of its local rank on the other hosts). "
         "These are the model's explicit CPU-share terms; on hosts with a core per rank "
         "both are neutral. Inside a netns host the ranks talk TCP "
         "too (no shared memory). Measured: the loop's phases summed, mean over ranks. "
         "Every run is the numpy job, unpipelined, fp32 rows."), "",
        ("| hosts x ranks, exchange | others' CPU during (before) | CPU share | co-runners "
         "| predicted ms | measured ms | measured / predicted | of it: compute, measured / "
         "predicted ms | the rest (exchange, allreduce, apply), measured / predicted | of "
         "the predicted rest: hand-offs | without the hand-offs: predicted ms (measured / "
         "predicted) | messages a step (measured / model) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in checks:
        meas = sum(c["messages_per_step"].get(k, 0) for k in ("pull:ids", "pull:rows",
                                                               "push:grads"))
        model = sum(c["model_messages"])
        mc = c["measured_phases_ms"]["compute"]
        pc = 1e3 * w["compute_s"] / c["cpu_share"]
        mr, pr = c["measured_ms"] - mc, c["predicted_ms"] - pc
        lines.append(f"| {c['label']} ({c['mode_seen']}) | {c['others_cores']:.2f} "
                     f"({c['others_busy_cores']:.2f}) | {c['cpu_share']:.2f} | "
                     f"{c['corunners']} | {c['predicted_ms']:.1f} | {c['measured_ms']:.1f} | "
                     f"**{c['ratio']:.2f}** | {mc:.1f} / {pc:.1f} | {mr:.1f} / {pr:.1f} | "
                     f"{c['handoffs_ms']:.1f} | {c['predicted_bare_ms']:.1f} "
                     f"({c['ratio_bare']:.2f}) | {meas:.0f} / {model} |")
    worst = max(checks, key=lambda c: abs(c["ratio"] - 1))
    worst_bare = max(checks, key=lambda c: abs(c["ratio_bare"] - 1))
    lines += ["", (f"Within 20% of every measured configuration: "
                   f"**{all(abs(c['ratio'] - 1) <= 0.2 for c in checks)}** (the "
                   f"farthest: {worst['label']}, {worst['ratio']:.2f}). Without the "
                   "hand-off term: "
                   f"{all(abs(c['ratio_bare'] - 1) <= 0.2 for c in checks)} (the farthest: "
                   f"{worst_bare['label']}, {worst_bare['ratio_bare']:.2f})."), ""]
    off = [c for c in checks if abs(c["ratio"] - 1) > 0.2]
    if off:
        why = []
        for c in off:
            mc = c["measured_phases_ms"]["compute"]
            pc = 1e3 * w["compute_s"] / c["cpu_share"]
            mr, pr = c["measured_ms"] - mc, c["predicted_ms"] - pc
            waits = sum(1 for st in sm.stages(c["ranks"], c["per_host"], c["topology"])
                        if st[2] + st[3]) + 1
            why.append(f"{c['label']}: compute {mc:.1f} ms measured, {pc:.1f} predicted "
                       f"({mc / pc:.2f}x); the rest {mr:.1f} against {pr:.1f} ({mr / pr:.2f}x: "
                       f"{(mr - pr) / waits:+.1f} ms in each of its {waits} collective "
                       f"waits a step); the other processes used {c['others_cores']:.2f} cores")
        lines += ["Where it misses: " + "; ".join(why) + ".", ""]
    d = r.get("deepfm")
    cur = r["curves"]
    lines += [(f"## {'DeepFM' if d is not None else 'The numpy job'} from 1 to 1,024 ranks "
              "(predicted)"), ""]
    if d is None:
        lines += [("Workload: the numpy job's above (no DeepFM run: --quick or "
                  "--scale-deepfm-steps 0), so these are not DeepFM's figures."), ""]
    else:
        wd = d["workload"]
        rounds = d.get("rounds", [])
        lines += [
            ("Workload: bench/train_worker.py --impl kvcoll (DeepFM, 26 fields, dim 8, MLP "
             "256-128, one TensorFlow thread a rank, batch 4096 a rank, not pipelined), "
             f"{len(rounds)} rounds of a 1-rank and a 2-rank launch, each brought to a core "
             "of its own; the median of each phase over the rounds, ms a step, on 1 rank: "
             + ", ".join(f"{k} {v:.2f}" for k, v in d["one"].items())
             + "; on 2 ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in d["two"].items())
             + f". Unique ids a batch: {d['unique_frac']:.3f} of its ids. Model workload (s): "
             + ", ".join(f"{k} {v:.4g}" for k, v in wd.items()) + "."), ""]
        if rounds:
            lines += [
                ("Each round on its own (multi_s, the multi-rank step's own CPU and waits, "
                 "is what the 2-rank run's exchange and allreduce took beyond its tables, "
                 "the 1-rank run's planning and the model's messages and bytes: a "
                 "difference of two runs' figures, so it moves most between rounds):"), "",
                ("| round | others' CPU before (1 / 2 ranks) | compute, 1 / 2 ranks ms | "
                 "exchange less tables, 1 / 2 ranks ms | multi_s ms | two-level + fp16 at "
                 "256 ranks, 25 Gb/s |"),
                "|---:|---:|---:|---:|---:|---:|"]
            for i, rd in enumerate(rounds, 1):
                o, t = rd["one"], rd["two"]
                b = rd["busy"]
                lines.append(
                    f"| {i} | {b[1]:.2f} / {b[2]:.2f} | {o['compute']:.1f} / "
                    f"{t['compute']:.1f} | {o['exchange'] - o['tables']:.1f} / "
                    f"{t['exchange'] - t['tables']:.1f} | {1e3 * rd['workload']['multi_s']:.1f} "
                    f"| {100 * rd['efficiency_256']:.0f}% |")
            lines.append("")
    lines += [
        (f"Hosts of {PER_HOST} ranks (sharing the host's link); inside a host shared memory "
         "as measured; across hosts the stated network: bandwidth 10, 25 or 100 Gb/s, and "
         f"a stage's latency = the netns TCP stage ({tcp['stage_s'] * 1e6:.1f} us) + "
         f"{r['wire_latency_s'] * 1e6:.0f} us of wire, NIC and switch (stated: issue #32's "
         "figure for TCP), each message adding the measured netns TCP message cost. "
         "Pipelined (kvcoll.step's prefetch): the next step's dedup/route and id exchange "
         "hide behind the dense compute, nothing else. Per-rank efficiency = samples/s a "
         "rank at P over 1 rank's."), "",
        "| network | exchange | rows | " + " | ".join(f"P={P}" for P in RANKS[1:]) + " |",
        "|---|---|---|" + "---:|" * (len(RANKS) - 1)]
    for c in cur:
        lines.append(f"| {c['network_gbit']} Gb/s | {c['topology']} | {c['wire']} | "
                     + " | ".join(f"{100 * p['efficiency']:.0f}%" for p in c["points"][1:])
                     + " |")
    target = _eff(cur, 25, "two-level", "fp16", 256)
    lim = r["limits"]
    lines += [
        "", (f"**Target: two-level + fp16 at 256 ranks on 25 Gb/s TCP: "
             f"{100 * target['efficiency']:.0f}% per-rank efficiency** (target >= 80%; "
             f"{target['samples_per_sec_per_rank']:.0f} samples/s a rank, "
             f"{target['step_ms']:.1f} ms a step)."), "",
        "What a step is made of there and at 1,024 ranks (two-level, fp16, 25 Gb/s, ms):", "",
        ("| ranks | step | CPU | message latency | bytes | dense allreduce | hidden by the "
        "pipeline |"), "|---:|---:|---:|---:|---:|---:|---:|"]
    for P in ("256", "1024"):
        x = lim.get(P, lim.get(int(P)))
        lines.append(f"| {P} | {x['step_ms']:.1f} | {x['cpu_ms']:.1f} | {x['latency_ms']:.2f} | "
                     f"{x['bytes_ms']:.2f} | {x['allreduce_ms']:.2f} | {x['overlap_ms']:.2f} |")
    x256 = lim.get(256, lim.get("256"))
    x1k = lim.get(1024, lim.get("1024"))
    multi = 1e3 * (d["workload"]["multi_s"] if d is not None else w["multi_s"])
    lines += ["", (
        f"What limits it: at 256 ranks the step is {x256['step_ms']:.1f} ms against "
        f"{x256['cpu_ms'] - multi:.1f} ms of one rank's own work; the difference is the "
        f"multi-rank step's own CPU and waits ({multi:.1f} ms, measured on 2 ranks: the "
        "counts, the packing, the Python around each all-to-all and the wait for the "
        f"slower rank), the bytes ({x256['bytes_ms']:.1f} ms: 8 ranks share the host's "
        f"link), the messages ({x256['latency_ms']:.2f} ms) and the allreduce "
        f"({x256['allreduce_ms']:.2f} ms), less what the pipeline hides "
        f"({x256['overlap_ms']:.2f} ms). Beyond 256 ranks the bytes a rank sends stay "
        "the same (weak scaling: the fraction owned elsewhere, (P-1)/P, is already about "
        "1) and the two-level exchange's messages across hosts grow with the hosts, "
        f"4 (H-1) a step: {x1k['latency_ms']:.2f} ms at 1,024 ranks (128 hosts); the "
        "allreduce's log2 P rounds grow slowly. The flat exchange's 4 (P-L) messages "
        "are what end it: see the flat rows above.")]
    pm = lim["per_message_20us"]
    fm = lim["flat_per_message_20us"]
    g = lambda m, k: m.get(k, m.get(str(k)))
    lines += [
        "", ("If every message cost 20 us (the issue's framing, not overlapped at all): "
             f"two-level + fp16 {100 * g(pm, 256):.0f}% at 256 and {100 * g(pm, 1024):.0f}% "
             f"at 1,024 ranks; flat {100 * g(fm, 256):.0f}% and {100 * g(fm, 1024):.0f}%."),
        ""]
    thr = r["two_level_threshold"]
    lines += [
        "## When two-level beats flat (kvcoll._topology.AUTO_TWO_LEVEL_MIN_RANKS)", "",
        (f"On the measured links (shared memory inside a host, netns TCP across), the "
         f"model's two-level step is shorter than the flat one on every host size of 2 to "
         f"32 ranks from **{thr['deepfm']} ranks** on (DeepFM's workload; "
         f"{thr['numpy_job']} for the numpy job's). Below that the two-level exchange's "
         "extra stages (10 a step instead of 4, each a wait of its own) cost more than "
         "the messages it saves; bench/results/topology.md measured it 1.41x slower at 3x2."),
        ""]
    if png:
        lines += [f"![per-rank efficiency]({os.path.basename(png)})", ""]
    return "\n".join(lines) + "\n"
