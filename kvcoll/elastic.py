"""Elastic training: a lost rank costs the survivors seconds, not the job.

Under the elastic launcher (`launch/kvcollrun --elastic --min-np N`: Open MPI with ULFM,
`mpirun --with-ft ulfm`, and KVCOLL_ELASTIC_MIN_NP=N for kv.init()) kvcoll's
communicator is elastic (kvcoll.comm), and every training step runs in a `Session`,
which turns a lost peer into a smaller world instead of the job's end:

1. Detection. A wait on a peer that died ends with MPI_ERR_PROC_FAILED (on the ranks
   that wait for it; about a second, ULFM's runtime tells them) or MPI_ERR_REVOKED (on
   the others: the first rank to see the loss revokes the communicator, so every rank's
   waits end at once, wherever they are). Either is a PeerLostError.
2. One vote per step. Every step attempt ends with ULFM's agreement (MPI_Comm_iagree:
   an AND over the live ranks that is the same on every rank that returns, even while
   ranks fail): a rank whose step completed votes yes just before applying it (the
   exchange's commit calls `Comm.gate`), a rank that lost a peer votes no. Only a
   unanimous yes applies the step, so a row was updated by every survivor's gradients of
   that step or by none, and the dense model, the optimizer state, the metrics and the
   step counter stay the same on every survivor. A no abandons the step on every rank
   alike (Loop.abandon: the rows it created go, nothing was applied), and every rank is
   then at the same point: the start of that step.
3. Shrink. The survivors shrink the revoked communicator (MPI_Comm_shrink: the ranks that
   have not failed, in their old order) into a new elastic one. A rank that finds itself
   outside a majority of the world before the loss (or in an even split, on the side
   without the lowest rank) is fenced: it exits at once, so a rank cut off from the
   others never writes a checkpoint or publishes again.
4. Below --min-np the survivors save what they hold (an incremental checkpoint of their
   rows when the chain allows it; else the lost buckets are refilled first and the save
   is full) and exit with EXIT_BELOW_MIN_NP and the reason.
5. The new owner map is `OwnerMap.without(lost)`: the survivors keep every bucket they
   had, and the lost ranks' buckets are shared among them (the fewest-loaded first).
6. Refill. Each survivor reads the rows of the buckets it took from the latest checkpoint
   chain (Checkpointer.refill: only those pages), so only the lost shard's updates since
   its last save are lost (CPR-style partial recovery). Without a checkpoint, those
   buckets start from their initial values, as new rows always do.
7. The loop, the exchange, the checkpointer and kv.rank()/kv.size() continue on the new
   communicator and map; callbacks' `on_world_change(old_size, new_size)` run; rank 0
   says what happened in one line, and the event (with its timings, seconds from the
   loss) goes to `events()` (what --metrics-out writes as "elastic_events") and to the
   launcher (a `kvcoll-elastic {json}` line). The step is attempted again on the new
   world.

A save run in a Session (kv.save, kv.callbacks.Checkpoint) is one attempt too: its vote
comes after rank 0's commit (Checkpointer.save), so a no makes the survivors save again.
What a failure elsewhere does: a loss outside a Session (evaluation, the end of an epoch)
ends the job, and the elastic launcher relaunches it on the survivors from the latest
checkpoint. After a loss, MPI_Finalize can hang (Open MPI issue 11404): an elastic run
never calls it (kvcoll.comm.skip_finalize); exit codes are kept.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from . import runtime
from .checkpoint import latest
from .comm import announce
from .errors import CommError, PeerLostError

__all__ = ["EXIT_BELOW_MIN_NP", "EXIT_FENCED", "Session", "enabled", "events",
           "replan_source"]

EXIT_BELOW_MIN_NP = 3   # the survivors saved and stopped: fewer than --min-np ranks left
EXIT_FENCED = 4         # this rank was outside the survivors' majority
MAX_RECOVERIES = 64     # in one step attempt (each one loses at least one rank)

_EVENTS: list = []


def events() -> list[dict]:
    """This process's elastic events, oldest first: {"kind": "lost", "ranks": the lost
    ranks (of the world before), "hosts", "mode": "in-memory", "step": the last step
    applied, "world": [before, after], "detect_s", "agree_s", "shrink_s", "refill_s",
    "first_step_after_s" (seconds from the loss to each moment: detected, agreed,
    shrunk, refilled, the first step after it applied), "rows_reverted" (refilled from
    the chain, over all ranks), "reverted_to_step" and "checkpoint" (the chain's latest;
    None without one)}."""
    return _EVENTS


def enabled() -> bool:
    """Whether this run is elastic (kv.init() under the elastic launcher)."""
    return runtime.is_initialized() and runtime.config().elastic_min_np > 0 and \
        getattr(runtime.comm(), "elastic", False)


def _say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


class Session:
    """The elastic side of one step loop (kvcoll.step.Loop): run each step attempt with
    `run`, which survives a lost peer (see the module docstring).

    min_np: the fewest ranks to continue on (default: the run's --min-np).
    checkpointer: the kvcoll.checkpoint.Checkpointer whose chain refills the lost
    buckets and which saves below --min-np (settable later; None: no refill).
    directory: where to save below --min-np if the checkpointer never saved (or a
    function returning it).
    on_comm(comm, owners): called with the survivors' communicator and owner map (the
    loop, the checkpointer and kv.rank() are taken care of here).
    callbacks(): the objects whose on_world_change(old_size, new_size) to call.
    save_on_loss: right after a recovery, save a delta of what the survivors hold (when
    the checkpointer's chain allows one; see _save_now).
    """

    def __init__(self, loop, *, min_np: int | None = None, checkpointer=None,
                 directory=None, on_comm=None, callbacks=None, save_on_loss: bool = True):
        self.loop = loop
        if min_np is None:
            min_np = runtime.config().elastic_min_np if runtime.is_initialized() else 1
        self.min_np = max(1, int(min_np))
        self.checkpointer = checkpointer
        self.directory = directory
        self.on_comm = on_comm
        self.callbacks = callbacks
        self.save_on_loss = bool(save_on_loss)
        self._voted = True
        self._t: dict = {}       # this attempt's moments of detection and agreement
        self._cause: str | None = None  # what this rank saw first of the loss (the event's)
        self._pending = None     # the last event, until the first step after it commits
        self.comm.gate = self._gate

    @property
    def comm(self):
        return self.loop.comm

    # -- one step ---------------------------------------------------------------------

    def run(self, attempt):
        """attempt(): one step attempt of the loop (every rank runs the same). Returns
        what it returns; on a lost peer, recovers (shrink, replan, refill) and runs
        attempt() again on the survivors. An error every rank raised alike (a bad batch)
        is raised once the ranks agreed no peer was lost meanwhile."""
        for _ in range(MAX_RECOVERIES):
            self._voted, self._t = False, {}
            try:
                out = attempt()
            except PeerLostError as exc:
                self._t.setdefault("detect", time.time())
                self._cause = self._cause or str(exc)
                if not self._voted:
                    self._vote(False)
                self.recover(exc)
                continue
            except Exception:
                if not self._voted and not self._vote(True):
                    self.recover(None)
                    continue
                raise
            if not self._voted and not self._vote(True):
                self.recover(None)   # nothing was applied in this attempt
                continue
            self._stepped()
            return out
        raise CommError(f"rank {self.comm.rank}: {MAX_RECOVERIES} losses in one step")

    def _vote(self, ok: bool) -> bool:
        """This attempt's one vote (see the module docstring): whether every live rank
        completed it. A unanimous yes with a failure reported meanwhile stands (the step
        is applied everywhere); the communicator is revoked so that the next step
        recovers."""
        self._voted = True
        self.loop.quiesce()     # no other thread of this rank in MPI during the agreement
        agreed, failed = self.comm.consensus(ok, "elastic:vote")
        if not agreed:
            self._t.setdefault("detect", time.time())
            self._t["agree"] = time.time()
            self._cause = self._cause or (
                "another rank voted that it lost a peer" if ok else None)
        elif failed:
            why = f"the step's vote was unanimous but reported a failure ({self.comm.agree_error})"
            self._cause = self._cause or why
            self.comm.revoke(why)
        return agreed

    def _gate(self) -> None:
        """The exchange's commit point: apply this step only if every live rank completed
        it (raises PeerLostError otherwise: the step is abandoned)."""
        if not self._vote(True):
            raise PeerLostError(f"rank {self.comm.rank}/{self.comm.size}: a peer was lost "
                                "during this step: it is abandoned on every survivor",
                                [], "commit")

    def _stepped(self) -> None:
        if self._pending is not None:
            ev, t_loss = self._pending
            self._pending = None
            ev["first_step_after_s"] = round(time.time() - t_loss, 3)

    # -- recovery -----------------------------------------------------------------------

    def recover(self, exc: PeerLostError | None) -> None:
        """After a vote that failed: shrink to the survivors, fence, replan, refill (see
        the module docstring). Every survivor calls it at the same point."""
        now = time.time()
        t_loss = now - (time.monotonic() - exc.since) \
            if exc is not None and exc.since is not None else now
        t = {"detect": now, "agree": now, **self._t}
        loop, old = self.loop, self.comm
        old.revoke(f"recovering from a lost peer ({self._cause or 'another rank voted so'})")
        try:
            loop.abandon()      # the step in flight: its created rows go, nothing applied
        except PeerLostError:
            pass
        first = (loop.ex.owners, old.rank)   # the map and rank before the loss
        owners, comm, lost = first[0], old, []
        while True:
            new, gone = comm.shrink("elastic:shrink")
            t["shrink"] = time.time()
            lost += [dict(comm.peers[r], rank=r, world=comm.size) for r in gone]
            self._fence(new, comm, gone)
            owners = owners.without(gone)
            try:
                self._move(new, owners)
                if new.size < self.min_np:
                    self._below_min(new, lost, first)
                rows, reverted_to, t_loss = self._refill(new, first, owners, t_loss)
                t["refill"] = time.time()
                self._save_now(new)
                # every survivor got here: the recovery holds (or another rank is lost)
                agreed, _ = new.consensus(True, "elastic:recovered")
                if not agreed:
                    raise PeerLostError("another rank was lost during the recovery")
                break
            except PeerLostError:
                new.revoke("another rank was lost during the recovery")
                comm = new
        self._report(old, new, lost, t_loss, t, rows, reverted_to)

    def _move(self, new, owners) -> None:
        """The loop, kv.rank()/kv.size(), the checkpointer and on_comm go to `new`."""
        self.loop.replan(new, owners)
        new.gate = self._gate
        if runtime.is_initialized():
            runtime.replace_comm(new)
        ck = self._checkpointer()
        if ck is not None:
            ck.replan(new, owners)
        if self.on_comm is not None:
            self.on_comm(new, owners)

    def _checkpointer(self):
        ck = self.checkpointer
        return ck() if callable(ck) and not hasattr(ck, "save") else ck

    def _fence(self, new, old, lost) -> None:
        """Exit at once unless the survivors are a majority of `old`, or exactly half of
        it holding its rank 0."""
        kept = sorted(set(range(old.size)) - set(lost))
        if 2 * new.size > old.size or (2 * new.size == old.size and kept[:1] == [0]):
            return
        host = old.peers[old.rank]["host"]
        sys.stderr.write(
            f"kvcoll: rank {old.rank} (host {host}) is fenced: it is one of {new.size} "
            f"rank(s) that still reach each other, not a majority of the {old.size}: "
            "exiting, so that it never writes a checkpoint or publishes again\n")
        announce({"event": "fenced", "ranks": [old.rank], "hosts": [host]})
        _exit(EXIT_FENCED)

    def _taken(self, new, first, owners) -> np.ndarray:
        """The buckets this rank owns now and did not before the loss (a mask)."""
        before, rank = first
        return (owners.array == new.rank) & (before.array != rank)

    def _refill(self, new, first, owners, t_loss: float):
        """Refill the buckets this rank took from the latest chain (a collective of the
        survivors, which also agree on the time of the loss: the earliest any saw).
        Returns (rows refilled over all ranks, the chain's step or None, the loss)."""
        ck = self._checkpointer()
        directory = ck.chain_dir if ck is not None else None
        name = latest(directory) if directory else None
        said = new.allgather_json([directory, name, t_loss], "elastic:chain")
        directory, name = said[0][:2]         # every survivor goes by rank 0's view
        t_loss = min(x[2] for x in said)
        if not name:
            return 0, None, t_loss
        info = ck.refill(directory, self._taken(new, first, owners), checkpoint=name)
        rows = int(new.allreduce(np.array([info.rows], np.int64), op="elastic:rows")[0])
        return rows, (info.step, info.name), t_loss

    def _save_now(self, new) -> None:
        """Right after a loss, a delta of what the survivors hold, when the chain allows
        one: if the runtime ends the job after all (Open MPI 5.0 ends every rank a while
        after it lost a host's daemon), the relaunch restores the survivors' rows as
        they are and only the lost buckets as the chain had them."""
        ck = self._checkpointer()
        if not self.save_on_loss or ck is None or ck.parent is None or not ck.chain_dir \
                or ck.parent.startswith(f"ckpt-{self.loop.step:010d}"):   # (saved just now)
            return
        with new.deadline("io"):
            info = ck.save(ck.chain_dir, self.loop.step, incremental=True)
        if new.rank == 0:
            _say(f"kvcoll: saved what the survivors hold at step {info.step:,} "
                 f"({info.name}, {info.rows:,} rows)")

    def _below_min(self, new, lost: list, first) -> None:
        """Fewer than --min-np ranks left: save what the survivors hold, exit (never
        returns)."""
        step = self.loop.step
        hosts = sorted({p["host"] for p in lost})
        reason = (f"{_who(lost)} lost at step {step:,}: {new.size} rank(s) left, fewer "
                  f"than --min-np {self.min_np}")
        saved, err = None, None
        ck = self._checkpointer()
        directory = (ck.chain_dir if ck is not None else None) or \
            (self.directory() if callable(self.directory) else self.directory)
        if ck is not None and directory:
            try:
                with new.deadline("io"):
                    if ck.parent is None and latest(directory) is not None:
                        # no delta possible: the lost buckets back from the chain, then full
                        ck.refill(directory, self._taken(new, first, ck.owners))
                    saved = ck.save(directory, step, incremental=True).path
            except Exception as exc:  # noqa: BLE001 - say why, then stop anyway
                err = f"{type(exc).__name__}: {exc}"
        what = (f"saved what the survivors hold in {saved}" if saved else
                f"could not save ({err})" if err else
                "nothing saved (no checkpoint directory is known: use "
                "kv.callbacks.Checkpoint or kv.save)")
        if new.rank == 0:
            sys.stderr.write(f"kvcoll: {reason}; {what}; exiting\n")
        announce({"event": "below_min_np", "reason": reason, "saved": saved,
                  "ranks": [p["rank"] for p in lost], "hosts": hosts})
        _exit(EXIT_BELOW_MIN_NP)

    def _report(self, old, new, lost, t_loss, t, rows, reverted_to) -> None:
        hosts = sorted({p["host"] for p in lost})
        step = self.loop.step

        def since(x):
            return round(max(0.0, x - t_loss), 3)

        cause, self._cause = self._cause, None
        ev = {"kind": "lost", "ranks": [p["rank"] for p in lost], "hosts": hosts,
              "cause": cause,
              "mode": "in-memory", "step": step, "world": [old.size, new.size],
              "detect_s": since(t["detect"]), "agree_s": since(t["agree"]),
              "shrink_s": since(t["shrink"]), "refill_s": since(t.get("refill", t_loss)),
              "first_step_after_s": None, "rows_reverted": rows,
              "reverted_to_step": reverted_to[0] if reverted_to else None,
              "checkpoint": reverted_to[1] if reverted_to else None}
        _EVENTS.append(ev)
        self._pending = (ev, t_loss)
        if new.rank == 0:
            tail = (f"{rows:,} rows reverted to step {reverted_to[0]:,}" if reverted_to
                    else "its buckets restart from their initial values (no checkpoint yet)")
            _say(f"kvcoll: {_who(lost)} lost at step {step:,}: continuing on {new.size} "
                 f"rank(s), {tail}")
        announce({"event": "lost", "mode": "in-memory", "ranks": ev["ranks"],
                  "hosts": hosts, "world": ev["world"],
                  "procs": [[p["host"], p["pid"]] for p in lost], "cause": cause})
        for cb in (self.callbacks() if self.callbacks is not None else ()):
            hook = getattr(cb, "on_world_change", None)
            if hook is not None:
                hook(old.size, new.size)


def replan_source(data, rank: int, world: int, consumed: int) -> bool:
    """A kvcoll data source of global batches (the position protocol, split "global":
    SyntheticCTR's batches, the readers with split="global"), or a one-pass wrapper of
    one (its fit_batches()): make it continue on rank `rank` of `world`, right after
    the first `consumed` batches of the current pass (the steps applied), so the global
    batches go on where they were, each rank taking its new part. Returns whether it
    did (False for any other data: it goes on as it is)."""
    source = data if hasattr(data, "position_at") else getattr(data, "_kvcoll_source", None)
    if getattr(source, "split", None) != "global" or not all(
            hasattr(source, a) for a in ("position_at", "resume", "rank", "world")):
        return False
    position = source.position_at(consumed)
    source.rank, source.world = rank, world
    source.resume(dict(position, rank=rank, world=world))
    if source is not data and hasattr(data, "restart"):   # the wrapper's pass: a new one
        data.restart()
    return True


def _who(lost: list) -> str:
    parts = [f"rank {p['rank']} (host {p['host']})" for p in lost]
    return ", ".join(parts) if parts else "a rank"


def _exit(code: int) -> None:
    """Leave now, without MPI_Finalize (it may hang after a lost peer)."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001, S110 - leaving anyway
            pass
    os._exit(code)

