"""The exchange's topology: flat or two-level, planned from the world's shape, and the
block arithmetic of a two-level all-to-all. Pure numpy, no MPI: kvcoll.comm runs it.

A flat all-to-all sends P-1 messages per rank per phase. The two-level one (TorchRec's
TWRW shape) on H hosts of L ranks each, rank (h, l) = grid[h, l]:

  level 1, inside a host: rank (h, l) sends to each rank (h, l') of its host the blocks
      it has for the ranks of local rank l' on every host, host after host
      (`level1_order`); rank (h, l') then holds, per source l and destination host h',
      the block (h, l) -> (h', l');
  level 2, across hosts: rank (h, l') sends to each rank (h', l') of its local rank the
      blocks for it, source after source (`level2_order`: a transpose of (l, h') to
      (h', l)); the receiver holds the blocks of (h, l) -> itself in (h, l) order;
  finally the blocks are put in source-rank order (`source_order`: nothing to do when
      ranks fill hosts in order, grid = arange(P).reshape(H, L)).

(L-1) + (H-1) messages per rank per phase instead of P-1, and the same bytes, counts and
order as the flat exchange: blocks are only moved, never combined.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import EXCHANGE_TOPOLOGIES as TOPOLOGIES
from .errors import InvalidArgumentError

__all__ = [
    "AUTO_TWO_LEVEL_MIN_RANKS",
    "TOPOLOGIES",
    "Topology",
    "level1_order",
    "level2_order",
    "permute_blocks",
    "plan",
    "source_order",
]

_HOW = ("kv.init(exchange_topology=...), --exchange-topology or KVCOLL_EXCHANGE_TOPOLOGY")

# The world size from which "auto" chooses two-level (on several hosts of the same number
# of ranks, more than one): below it the two-level exchange's extra rounds (10 a step
# instead of 4, each a wait of its own) cost more than the messages it saves. From the
# scale model on the measured TCP and shared-memory figures (bench/results/scale.md,
# "When two-level beats flat": the smallest P from which two-level is faster on every
# host size of 2 to 32 ranks, for the DeepFM workload). It moves with the measured
# shared-memory stage latency and TCP message cost: six runs of the bench on the shared
# 2-core machine put it at 46, 76, 80, 108, 110 and 114 ranks; this is the committed run's.
# bench/results/topology.md measured two-level 1.4x slower at 3 hosts x 2.
AUTO_TWO_LEVEL_MIN_RANKS = 114


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """How a communicator's all-to-alls go.

    mode: "flat" or "two-level". grid: (hosts, ranks per host), grid[h, l] = the rank
    that is local rank l on host h (hosts in the order of their lowest rank; local ranks
    in rank order); None when flat. why: the reason for the mode, in words (logs, docs).
    """

    mode: str
    grid: np.ndarray | None
    why: str

    @property
    def two_level(self) -> bool:
        return self.mode == "two-level"

    @property
    def hosts(self) -> int:
        return 0 if self.grid is None else int(self.grid.shape[0])

    @property
    def per_host(self) -> int:
        return 0 if self.grid is None else int(self.grid.shape[1])

    def where(self, rank: int) -> tuple[int, int]:
        """(host index, local index) of `rank` (two-level only)."""
        h, l = np.argwhere(self.grid == rank)[0]
        return int(h), int(l)

    def __str__(self) -> str:
        if self.two_level:
            return f"two-level ({self.hosts} hosts x {self.per_host} ranks): {self.why}"
        return f"flat: {self.why}"


def _shape(labels: list[str]) -> tuple[list[str], dict[str, list[int]]]:
    """The hosts in the order of their lowest rank, and each one's ranks (in order)."""
    ranks: dict[str, list[int]] = {}
    for r, h in enumerate(labels):
        ranks.setdefault(h, []).append(r)
    return list(ranks), ranks


def describe_shape(labels: list[str], most: int = 6) -> str:
    """The world's shape in words: '3 hosts: a 2 ranks, b 1, c 2' (at most `most` named)."""
    order, ranks = _shape(labels)
    named = ", ".join(f"{h} {len(ranks[h])}" for h in order[:most])
    more = f", ... ({len(order) - most} more)" if len(order) > most else ""
    return f"{len(labels)} rank(s) on {len(order)} host(s): {named}{more}"


def plan(labels: list[str], setting: str = "auto", strict: bool = True) -> Topology:
    """The topology of a world whose rank r runs on host labels[r].

    setting: "auto" (two-level when the world spans more than one host, every host runs
    the same number of ranks, more than one, and there are at least
    AUTO_TWO_LEVEL_MIN_RANKS ranks; flat otherwise), "flat", or
    "two-level" (two-level on any even shape, even one host or one rank per host; on
    hosts of different sizes an InvalidArgumentError naming the shape and the fix, or,
    with strict=False (a world that changed after a loss), flat).

        plan(["a", "a", "b", "b"], "two-level")  ->  two-level, grid [[0, 1], [2, 3]]
        plan(["a", "b", "a", "b"], "two-level")  ->  two-level, grid [[0, 2], [1, 3]]
        plan(["a", "a", "b", "b"])  ->  flat (4 ranks: fewer than AUTO_TWO_LEVEL_MIN_RANKS)
        plan(["a", "a", "b"])       ->  flat (hosts of 2 and 1 ranks)
    """
    if setting not in TOPOLOGIES:
        raise InvalidArgumentError(
            f"exchange_topology {setting!r} is unknown; use one of {', '.join(TOPOLOGIES)} "
            f"({_HOW})")
    order, ranks = _shape(list(labels))
    sizes = {len(ranks[h]) for h in order}
    even = len(sizes) == 1
    if setting == "flat":
        return Topology("flat", None, "set to flat")
    if len(labels) <= 1:
        return Topology("flat", None, "one rank")
    if not even:
        if setting == "two-level" and strict:
            raise InvalidArgumentError(
                f"exchange_topology 'two-level' needs the same number of ranks on every host, "
                f"but this world has {describe_shape(labels)}; start as many ranks on every "
                f"host (mpirun --map-by ppr:N:node, or a hostfile with equal slots) or use "
                f"'auto' or 'flat' ({_HOW})")
        return Topology("flat", None, f"hosts of different sizes ({describe_shape(labels)})")
    grid = np.array([ranks[h] for h in order], np.int64)
    if setting == "auto":
        if grid.shape[0] == 1:
            return Topology("flat", None, "one host")
        if grid.shape[1] == 1:
            return Topology("flat", None, "one rank per host")
        if len(labels) < AUTO_TWO_LEVEL_MIN_RANKS:
            return Topology("flat", None, (
                f"chosen by auto: {len(labels)} ranks, fewer than {AUTO_TWO_LEVEL_MIN_RANKS}, "
                "where the two-level exchange's extra rounds cost more than the messages it "
                "saves (bench/results/scale.md)"))
        return Topology("two-level", grid, (
            f"chosen by auto: several hosts of equal size and {len(labels)} ranks, at "
            f"least {AUTO_TWO_LEVEL_MIN_RANKS}"))
    return Topology("two-level", grid, "set to two-level")


# -- the block arithmetic --------------------------------------------------------------
#
# A buffer holds blocks one after another along axis 0; an order says which block goes
# where: out block j is in block order[j]. The blocks are the (source, destination) pairs
# of the exchange; what a block holds (rows of k parts) is never looked into.

def level1_order(grid: np.ndarray) -> np.ndarray:
    """The send buffer's blocks (one per destination rank, in rank order) as level 1
    sends them: local rank l' after local rank l', within each host after host, i.e. the
    blocks of grid[:, l'] for l' = 0, 1, ..."""
    return np.ascontiguousarray(grid.T).reshape(-1)


def level2_order(hosts: int, per_host: int) -> np.ndarray:
    """Level 1's received blocks, (source l, destination host h') in l-major order, as
    level 2 sends them: destination host after host, within each source after source."""
    return np.arange(per_host * hosts).reshape(per_host, hosts).T.reshape(-1)


def source_order(grid: np.ndarray) -> np.ndarray | None:
    """Level 2's received blocks, (source host h, source local l) in h-major order, in
    source-rank order; None when they are in it already (ranks fill hosts in order)."""
    flat = grid.reshape(-1)
    if np.array_equal(flat, np.arange(flat.size)):
        return None
    return np.argsort(flat, kind="stable")


def permute_blocks(buf: np.ndarray, lens: np.ndarray, order: np.ndarray | None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """The blocks of `buf` (lens[i] elements each along axis 0, one after another) in
    `order` (out block j = block order[j]); `buf` itself when order is None or keeps
    every block in place. One slice copy per run of blocks that stay adjacent, never one
    per element. out: where to write (shaped like buf), default a new array.

        permute_blocks([1, 2, 3, 4, 5], lens=[2, 0, 3], order=[2, 1, 0])  ->  [3, 4, 5, 1, 2]
    """
    buf = np.asarray(buf)
    lens = np.asarray(lens, np.int64).reshape(-1)
    if int(lens.sum()) != buf.shape[0]:
        raise ValueError(f"blocks of {int(lens.sum())} rows in a buffer of {buf.shape[0]}")
    if order is None:
        return buf
    order = np.asarray(order, np.int64).reshape(-1)
    if order.size != lens.size:
        raise ValueError(f"{order.size} positions for {lens.size} blocks")
    starts = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    n = lens[order]
    src = starts[:-1][order]
    keep = n > 0
    src, n = src[keep], n[keep]
    if n.size == 0 or (n.size == 1 and src[0] == 0) or \
            (np.all(src[1:] == src[:-1] + n[:-1]) and src[0] == 0):
        return buf if out is None else _copy_into(out, buf)
    if out is None:
        out = np.empty_like(buf)
    # runs: consecutive output blocks that are consecutive in the input too
    breaks = np.flatnonzero(src[1:] != src[:-1] + n[:-1]) + 1
    run_src = src[np.r_[0, breaks]]
    run_len = np.add.reduceat(n, np.r_[0, breaks])
    at = 0
    for s, k in zip(run_src.tolist(), run_len.tolist()):
        out[at:at + k] = buf[s:s + k]
        at += k
    return out


def _copy_into(out: np.ndarray, buf: np.ndarray) -> np.ndarray:
    out[...] = buf
    return out
