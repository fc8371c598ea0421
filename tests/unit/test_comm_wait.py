"""kvcoll.comm's waits: a deadline counts the time this process ran, not time it was
stopped (SIGSTOP then SIGCONT, a paused VM), so a rank continued after a pause does not
blame a peer for it; a peer that stays silent still times out."""

import time

import pytest

from kvcoll import comm
from kvcoll.errors import CommTimeoutError


def test_a_silent_peer_times_out():
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="no answer"):
        comm._poll_until(lambda: False, 0.2, lambda: "no answer")
    assert 0.2 <= time.monotonic() - t0 < 1.0


def test_time_this_process_was_stopped_does_not_count():
    calls = []

    def ready():  # the process is "stopped" for longer than the limit between two polls
        calls.append(time.monotonic())
        if len(calls) == 3:
            time.sleep(comm.STALLED + 0.3)
        return len(calls) >= 50

    comm._poll_until(ready, 1.0, lambda: "no answer")   # before: CommTimeoutError
    assert len(calls) == 50
