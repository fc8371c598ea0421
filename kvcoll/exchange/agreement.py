"""A step's agreement: what each rank brings to a step, and what the ranks decided.

A step has two moments where ranks must decide alike, or a synchronous run would
diverge or hang:

1. before anything changes (it rides the pull's id exchange): does the step happen at
   all? Every rank votes with its `Agreement`: how many samples it has, whether its data
   has run out, whether its batch was bad (the error), whether it was asked to stop. The
   step goes on when no batch was bad, no rank asked to stop and some rank has samples.
   When no rank has samples but some rank's data has not run out (a stream waiting for
   files), the ranks are idle together: the step does not happen and is tried again.
2. after the compute (it rides the push's allreduce): did every rank's compute succeed?
   Each rank reports an outcome code (OK, NONFINITE: a NaN/Inf loss or gradient,
   FAILED: an exception); any code other than OK anywhere abandons the step on every
   rank.

The exchange carries the object (`header()` out, `settle()` in; `outcome_code()` out,
`settle_outcome()` in) and the step loop reads it (`proceeds`, `failed`, `idle`,
`all_done`, `outcome_failed`). In SSP/ASP ranks do not step together: the exchange
settles the agreement with this rank's vote alone.

Example on 2 ranks, rank 1's batch bad:
    rank 0: Agreement(samples=512)                 rank 1: Agreement(samples=0, error=e)
    after the pull on both: proceeds False, failed == [1]: both raise the same error.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Agreement", "OK", "NONFINITE", "FAILED", "HEADER_WORDS"]

OK, NONFINITE, FAILED = 0, 1, 2
# header words: has samples, batch ok, samples, stop asked, data done
HEADER_WORDS = 5


class Agreement:
    """One rank's vote for one step, and (once settled) every rank's.

    samples: this rank's samples in the step (0: none); done: its data has run out;
    error: the exception that made its batch unusable (None: fine); stop: a callback or
    a preemption asked to stop before this step.
    """

    __slots__ = ("samples", "done", "error", "stop", "votes", "ranks", "outcome",
                 "outcome_error", "codes")

    def __init__(self, samples: int = 0, *, done: bool = False,
                 error: BaseException | None = None, stop: bool = False):
        self.samples = int(samples) if error is None else 0
        self.done = bool(done)
        self.error = error
        self.stop = bool(stop)
        self.votes: np.ndarray | None = None   # (voters, HEADER_WORDS) once settled
        self.ranks: np.ndarray | None = None   # the rank of each row of votes
        self.outcome = OK                      # this rank's compute outcome
        self.outcome_error: BaseException | None = None
        self.codes: np.ndarray | None = None   # every rank's outcome, once settled

    # -- moment 1: does the step happen --------------------------------------------------

    def header(self) -> np.ndarray:
        """This rank's vote as int64 words (what the exchange sends every rank)."""
        return np.array([int(self.samples > 0), int(self.error is None), self.samples,
                         int(self.stop), int(self.done)], np.int64)

    def settle(self, headers: np.ndarray | None, rank: int = 0) -> "Agreement":
        """Record every rank's vote ((world, HEADER_WORDS)); None: this rank's (`rank`)
        alone, as SSP/ASP decide."""
        if headers is None:
            self.votes, self.ranks = self.header()[None, :], np.array([rank])
        else:
            self.votes = np.asarray(headers, np.int64).reshape(-1, HEADER_WORDS)
            self.ranks = np.arange(self.votes.shape[0])
        return self

    def _votes(self) -> np.ndarray:
        if self.votes is None:
            raise AssertionError("the agreement has not been settled by an exchange")
        return self.votes

    @property
    def failed(self) -> list[int]:
        """Ranks whose batch was bad."""
        return [int(r) for r in self.ranks[self._votes()[:, 1] == 0]]

    @property
    def stopped(self) -> bool:
        """Some rank asked to stop."""
        return bool(self._votes()[:, 3].any())

    @property
    def total_samples(self) -> int:
        return int(self._votes()[:, 2].sum())

    @property
    def all_done(self) -> bool:
        """Every rank's data has run out (and none has samples)."""
        v = self._votes()
        return bool(v[:, 4].all()) and not v[:, 0].any()

    @property
    def idle(self) -> bool:
        """No rank has samples, none failed or asked to stop, and some rank's data goes on
        (a stream waiting for data): the step does not happen; try again."""
        v = self._votes()
        return not v[:, 0].any() and not self.failed and not self.stopped \
            and not bool(v[:, 4].all())

    @property
    def proceeds(self) -> bool:
        """The step happens: no bad batch, no stop, and some rank has samples."""
        v = self._votes()
        return not self.failed and not self.stopped and bool(v[:, 0].any())

    # -- moment 2: did every rank's compute succeed ---------------------------------------

    def report(self, code: int, error: BaseException | None = None) -> None:
        """This rank's compute outcome (OK, NONFINITE or FAILED)."""
        self.outcome, self.outcome_error = int(code), error

    def outcome_codes(self, world: int, rank: int) -> np.ndarray:
        """This rank's outcome as a float32 vector of world codes (its own set), for a sum."""
        out = np.zeros(world, np.float32)
        out[rank] = self.outcome
        return out

    def settle_outcome(self, codes: np.ndarray) -> None:
        """Record every rank's outcome code (a vector of world codes: the sum over ranks
        of outcome_codes, or this rank's own in SSP/ASP); a code that is not a number
        (a sum an elastic recovery left undefined) is FAILED."""
        codes = np.asarray(codes, np.float64)
        self.codes = np.where(np.isfinite(codes), np.rint(codes), FAILED).astype(np.int64)

    @property
    def outcome_failed(self) -> list[int]:
        """Ranks whose compute did not succeed (empty: the step may be committed)."""
        if self.codes is None:
            raise AssertionError("the outcome has not been settled by an exchange")
        return [int(r) for r in np.flatnonzero(self.codes)]
