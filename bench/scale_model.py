"""The scale model: a training step's seconds on P ranks, from measured phase costs and
measured (or stated) network figures. Pure Python, no MPI, no numpy.

    w = Workload(batch=4096, ids_per_sample=26, unique_frac=0.5, dim=9, n_dense=90_000,
                 compute_s=0.025, tables_s=0.013, plan_s=0.002, apply_s=0.002, multi_s=0.008)
    shm = Link("shared memory", stage_s=20e-6, message_s=0.4e-6, bandwidth=6e9)
    tcp = Link("25 Gb/s TCP", stage_s=47e-6, message_s=7.5e-6, bandwidth=25 * GBIT)
    c = Cluster(ranks=256, per_host=8, intra=shm, inter=tcp)
    step_seconds(w, c, "two-level", wire_bytes=2).total   # seconds a step
    efficiency(w, c, "two-level", wire_bytes=2)              # samples/s per rank vs 1 rank

What a step on one rank costs (bench/results/scale.md says where each figure comes from):

- CPU terms, measured on 1 and 2 ranks: the dense compute (per-sample work at this
  batch), the tables' C work (lookups, gradient apply: per id this rank serves; in
  expectation a rank serves as many ids as it asks for, whatever P), the exchange's own
  CPU (dedup/route: `plan_s`, on 1 rank), the dense apply; and on more than one rank
  the per-step CPU and waits that only a multi-rank step has (`multi_s`: counts,
  headers, wire packing, the Python around each all-to-all, the wait for the slower
  rank), measured on 2 ranks beyond what the message and byte terms below account for.
  All of them are divided by the rank's CPU share (1 on hosts of their own; below 1 when
  ranks and other processes outnumber the cores, as on the oversubscribed netns hosts).
- stage and message terms: each all-to-all stage waits for its link's latency
  (`Link.stage_s`), and each message it sends adds the link's per-message cost
  (`Link.message_s`); on a shared core all of it takes 1/share as long. Flat: 4 stages
  a step (ids' counts, ids, rows, row gradients), each a message to each of the P - 1
  others (L - 1 on its host, P - L across hosts), waiting for the slower link. Two-level
  (kvcoll.comm's TwoLevelHandle, as Comm.messages counts it): 10 stages, one after
  another, inside the host (L - 1 messages) or across hosts (H - 1): ids 2(L-1) + 2(H-1)
  messages, rows and gradients 2(L-1) + (H-1) each (the counts inside the host go
  first).
- byte terms: bytes / bandwidth. A rank's batch has U = batch x ids_per_sample x
  unique_frac unique ids; a fraction (P-1)/P of them is owned elsewhere. It sends their
  ids (8 bytes), receives their rows and sends their gradients (dim x wire_bytes each),
  and as an owner it serves as many. Flat: (L-1)/P of it inside the host, (P-L)/P across
  hosts; two-level: (L-1)/L inside the host (level 1), then (H-1)/H across hosts (level
  2), plus one more copy of the rank's part (the block permutes). The NIC is shared by
  the L ranks of a host that send at once: a rank's bandwidth across hosts is the link's
  / L.
- the dense allreduce (Comm.iallreduce = MPI_Iallreduce, Open MPI's libnbc): binomial
  tree (reduce, then broadcast: 2 log2 P steps of the whole vector) below 64 KiB or P < 4,
  else reduce-scatter + allgather (Rabenseifner: 2 log2 P steps, 2 (P-1)/P x bytes).
  Ring (the NCCL/Horovod shape, 2(P-1) steps) is not what libnbc picks by default.
- the scheduler's hand-offs: when ranks (and other busy processes) outnumber the cores,
  a BSP collective ends only when its slowest rank has been back on a core, which takes
  the scheduler milliseconds, not the stage's microseconds. Each collective (every
  all-to-all stage with a message, and the allreduce) waits `Cluster.handoff_s` per task
  that shares the slowest rank's core (`Cluster.corunners`: ceil(tasks / cores) - 1),
  times the fraction of the other ranks it exchanges with: 1 for the flat stages and the
  allreduce, (L-1)/(P-1) or (H-1)/(P-1) for a two-level stage (a co-runner holds the
  stage up only if it is one of its partners). `handoff_s` is measured on 2 ranks that
  share the cores with a busy process; on hosts with a core per rank there is no
  co-runner and the term is 0.
- overlap: BSP's pipeline (kvcoll.step's prefetch) runs the next step's dedup/route and
  id exchange while this step's dense compute runs; rows are looked up only after the
  update, so only `plan_s` and the ids' stages (messages and bytes) hide behind compute,
  at most the compute's length. The measured jobs here run unpipelined (pipelined=False).
- efficiency: samples/s per rank at P over the same at P = 1 (no exchange at all).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "GBIT",
    "Cluster",
    "Link",
    "Step",
    "Workload",
    "allreduce_seconds",
    "collectives",
    "efficiency",
    "messages",
    "samples_per_sec",
    "stages",
    "step_seconds",
    "two_level_threshold",
    "two_level_wins",
]

GBIT = 1e9 / 8   # bytes/s of 1 Gb/s


@dataclasses.dataclass(frozen=True)
class Link:
    """A transport: seconds a stage of an all-to-all takes before its first message is
    in (the one-way latency and the wait's wake-up: `stage_s`), seconds each message adds
    (the sender's and receiver's per-message work: `message_s`), and the bytes/s one
    sender gets."""

    name: str
    stage_s: float
    message_s: float
    bandwidth: float

    def __post_init__(self):
        if not (self.stage_s >= 0 and self.message_s >= 0 and self.bandwidth > 0):
            raise ValueError(f"link {self.name!r}: latencies must be >= 0 and bandwidth > 0, "
                             f"got {self.stage_s!r} s, {self.message_s!r} s and "
                             f"{self.bandwidth!r} B/s")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One rank's step: its batch, ids and the measured CPU seconds of each phase."""

    batch: int                # samples per rank per step
    ids_per_sample: float     # ids a sample looks up (all fields)
    unique_frac: float        # unique ids of a rank's batch / its ids
    dim: float                # floats of a row (the mean over tables)
    n_dense: int              # floats of the dense gradient (allreduced)
    compute_s: float          # dense forward + backward, one rank alone
    tables_s: float           # the tables' C work (lookups, gradient apply)
    plan_s: float             # the exchange's CPU beyond the tables on 1 rank (dedup, route)
    apply_s: float            # the dense optimizer's apply and the step's glue
    multi_s: float = 0.0      # CPU only a multi-rank step has (measured on 2 ranks)

    @property
    def unique(self) -> float:
        return self.batch * self.ids_per_sample * self.unique_frac


@dataclasses.dataclass(frozen=True)
class Cluster:
    """P ranks on hosts of `per_host` ranks; `cpu_share`: the share of a core a rank gets
    (1 on hosts of their own; cores / ranks when ranks outnumber the cores);
    `corunners`: the other tasks that share the slowest rank's core (0 when every rank
    has a core of its own); `handoff_s`: the seconds a collective waits for the scheduler
    per co-runner (see the module docstring)."""

    ranks: int
    per_host: int
    intra: Link
    inter: Link
    cpu_share: float = 1.0
    nic_shared: bool = True   # the L ranks of a host share its link's bandwidth
    corunners: int = 0
    handoff_s: float = 0.0

    def __post_init__(self):
        if self.ranks < 1 or self.per_host < 1 or self.ranks % self.per_host:
            raise ValueError(f"{self.ranks} ranks do not fill hosts of {self.per_host}")
        if not 0 < self.cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {self.cpu_share}")
        if self.corunners < 0 or not self.handoff_s >= 0:
            raise ValueError(f"corunners and handoff_s must be >= 0, got {self.corunners} "
                             f"and {self.handoff_s}")

    @property
    def hosts(self) -> int:
        return self.ranks // self.per_host


@dataclasses.dataclass
class Step:
    """A step's seconds by term (total = their sum - overlap)."""

    cpu: float
    latency: float
    bytes: float
    allreduce: float
    overlap: float = 0.0
    parts: dict = dataclasses.field(default_factory=dict)
    handoffs: float = 0.0     # the collectives' waits for the scheduler

    @property
    def total(self) -> float:
        return (self.cpu + self.latency + self.bytes + self.allreduce + self.handoffs
                - self.overlap)


def stages(ranks: int, per_host: int, topology: str) -> list[tuple[str, str, int, int]]:
    """A step's all-to-all stages, in order, as one rank sees them: (phase, the link
    whose latency the stage waits for: "intra" or "inter", messages it sends inside its
    host, messages it sends across hosts). A stage with no message costs nothing."""
    L, H = per_host, ranks // per_host
    if ranks == 1:
        return []
    if topology == "flat":
        link = "inter" if H > 1 else "intra"
        one = (L - 1, ranks - L)
        return [(ph, link, *one) for ph in ("ids:counts", "ids", "rows", "grads")]
    if topology == "two-level":
        # kvcoll.comm's TwoLevelHandle: counts inside the host, counts across hosts
        # (only without known receive counts), payload inside, payload across
        out = [("ids:counts", "intra", L - 1, 0), ("ids:counts", "inter", 0, H - 1),
               ("ids", "intra", L - 1, 0), ("ids", "inter", 0, H - 1)]
        for ph in ("rows", "grads"):
            out += [(ph + ":counts", "intra", L - 1, 0), (ph, "intra", L - 1, 0),
                    (ph, "inter", 0, H - 1)]
        return out
    raise ValueError(f"topology {topology!r}: use 'flat' or 'two-level'")


def messages(ranks: int, per_host: int, topology: str) -> tuple[int, int]:
    """Messages a rank sends per step: (inside its host, across hosts)."""
    st = stages(ranks, per_host, topology)
    return sum(s[2] for s in st), sum(s[3] for s in st)


def collectives(ranks: int, per_host: int, topology: str) -> float:
    """The collectives a step waits in (its all-to-all stages that send a message, and
    the allreduce; none on one rank), each counted by the fraction of the other ranks
    it exchanges with: the step's waits for the scheduler, in flat stages."""
    if ranks == 1:
        return 0.0
    return sum((s[2] + s[3]) / (ranks - 1) for s in stages(ranks, per_host, topology)) + 1


def allreduce_seconds(n_bytes: float, ranks: int, link: Link) -> float:
    """MPI_Iallreduce of n_bytes over `ranks` (Open MPI's libnbc choice, see the module
    docstring), every step over `link` (the slowest one it crosses)."""
    if ranks <= 1 or n_bytes <= 0:
        return 0.0
    rounds = math.ceil(math.log2(ranks))
    if ranks < 4 or n_bytes < 65536:
        return 2 * rounds * (link.stage_s + link.message_s + n_bytes / link.bandwidth)
    return (2 * rounds * (link.stage_s + link.message_s)
            + 2 * (ranks - 1) / ranks * n_bytes / link.bandwidth)


def step_seconds(w: Workload, c: Cluster, topology: str = "flat", wire_bytes: int = 4,
                 pipelined: bool = False) -> Step:
    """The seconds of one step of workload w on cluster c (see the module docstring)."""
    P, L, H = c.ranks, c.per_host, c.hosts
    share = c.cpu_share
    cpu = (w.compute_s + w.tables_s + w.plan_s + w.apply_s + (w.multi_s if P > 1 else 0.0))
    cpu /= share
    if P == 1:
        return Step(cpu, 0.0, 0.0, 0.0, parts={"cpu": cpu})
    # a stage waits for its link's latency, then each message adds its cost; on a shared
    # core all of it takes 1/share as long (it is the ranks' CPU and their wake-ups)
    links = {"intra": c.intra, "inter": c.inter}
    lat = {}
    for ph, which, a, b in stages(P, L, topology):
        if a + b == 0:
            continue
        t = links[which].stage_s + a * c.intra.message_s + b * c.inter.message_s
        ph = ph.split(":")[0] if ph != "ids:counts" else ph
        lat[ph] = lat.get(ph, 0.0) + t / share
    # bytes a rank sends per stage (and as many it receives), for ids owned elsewhere
    u = w.unique
    per = {"ids:counts": 0.0, "ids": 8.0 * u, "rows": u * w.dim * wire_bytes,
           "grads": u * w.dim * wire_bytes}
    inter_bw = c.inter.bandwidth / (L if c.nic_shared else 1)
    byte_s = {}
    for s, b in per.items():
        if topology == "flat":
            t = b * (L - 1) / P / c.intra.bandwidth + b * (P - L) / P / inter_bw
        else:
            t = (b * (L - 1) / L / c.intra.bandwidth      # level 1, inside the host
                 + b * (H - 1) / H / inter_bw              # level 2, across hosts
                 + (b / c.intra.bandwidth if L > 1 and H > 1 else 0.0))   # permutes
        byte_s[s] = t / share     # copies through the kernel: CPU work too
    # the allreduce crosses hosts when there are several
    ar_link = c.inter if H > 1 else c.intra
    ar = allreduce_seconds(4.0 * (w.n_dense + 2 + P), P, ar_link) / share
    overlap = 0.0
    if pipelined:
        hidden = (w.plan_s / share + lat.get("ids:counts", 0.0) + lat.get("ids", 0.0)
                  + byte_s["ids"])
        overlap = min(w.compute_s / share, hidden)
    # the scheduler's hand-offs (wall time, not the rank's CPU: not stretched by share)
    hand = collectives(P, L, topology) * c.corunners * c.handoff_s
    parts = {"cpu": cpu, **{f"latency:{s}": v for s, v in lat.items()},
             **{f"bytes:{s}": v for s, v in byte_s.items()}, "allreduce": ar}
    if hand:
        parts["handoffs"] = hand
    return Step(cpu, sum(lat.values()), sum(byte_s.values()), ar, overlap, parts, hand)


def samples_per_sec(w: Workload, c: Cluster, topology: str = "flat", wire_bytes: int = 4,
                    pipelined: bool = False) -> float:
    """Samples a rank trains per second."""
    return w.batch / step_seconds(w, c, topology, wire_bytes, pipelined).total


def efficiency(w: Workload, c: Cluster, topology: str = "flat", wire_bytes: int = 4,
               pipelined: bool = False) -> float:
    """Samples/s per rank on c over the same on one rank of its own (share 1)."""
    one = Cluster(1, 1, c.intra, c.inter)
    return (samples_per_sec(w, c, topology, wire_bytes, pipelined)
            / samples_per_sec(w, one, topology, wire_bytes, pipelined))


def two_level_wins(w: Workload, c: Cluster, wire_bytes: int = 4) -> bool:
    """Whether the two-level exchange's step is shorter than the flat one's on c."""
    return (step_seconds(w, c, "two-level", wire_bytes).total
            < step_seconds(w, c, "flat", wire_bytes).total)


def two_level_threshold(w: Workload, intra: Link, inter: Link, per_host=(2, 4, 8, 16, 32),
                        most: int = 2048, wire_bytes: int = 4) -> int:
    """The smallest world size P from which two-level beats flat on every shape: for
    every Q in [P, most] and every L in per_host with Q = L x H, H >= 2. `most` + 1 when
    even `most` ranks are not enough."""
    best = most + 1
    for P in range(most, 3, -1):
        shapes = [L for L in per_host if P % L == 0 and P // L >= 2]
        if all(two_level_wins(w, Cluster(P, L, intra, inter), wire_bytes) for L in shapes):
            best = P if shapes else best
        elif shapes:
            break
    return best
