"""kvcoll serve applying a delta live (kvcoll/serve/model.py): paced by apply_share, it
pauses between its pieces (pages staged, the overlay, chunks of rows written) so that its
work is at most that share of its time, and ends with the same rows as an apply without
pauses. A server behind by several versions applies all but the newest at full speed.
A share outside (0, 1] is refused, by ServedModel and by the CLI."""

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_publish_keras import trained  # noqa: E402

from kvcoll.publish import read_latest  # noqa: E402
from kvcoll.serve import cli  # noqa: E402
from kvcoll.serve.model import ServedModel  # noqa: E402


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("apply") / "pub")
    trained(d, every_n_steps=2, base_every=100)   # a base, then deltas only
    return d, read_latest(d)


def _set_latest(d, v):
    with open(os.path.join(d, "latest"), "w") as f:
        f.write(f"{v}\n")


def _rows(model):
    out = {}
    for name, t in model.tables.items():
        e = t.export()
        order = np.argsort(e["keys"])
        out[name] = (e["keys"][order], e["values"][order])
    return out


def _serve_then_apply(d, latest, share, monkeypatch):
    """A server loaded at the base (version 1), then every delta after it applied live;
    returns (its rows, the pauses the applies asked for as (deltas applied before it,
    seconds), the newest delta's apply seconds)."""
    _set_latest(d, 1)
    try:
        model = ServedModel(d, apply_share=share)
    finally:
        _set_latest(d, latest)
    model.chunk = 3                          # several chunks of rows a delta
    asked = []
    monkeypatch.setattr(time, "sleep", lambda s: s != 0.0005 and  # (not _drop_old's polls)
                        asked.append((model.applied, s)))  # (asked, not slept)
    got = model.poll()
    monkeypatch.undo()
    assert got == {"applied": latest - 1, "refused": []} and model.version == latest
    rows, spent = _rows(model), model.apply_seconds[-1]
    model.close()
    return rows, asked, spent


def test_the_newest_delta_is_paced_the_ones_before_it_are_not_and_rows_are_equal(
        published, monkeypatch):
    d, latest = published
    assert latest >= 4
    plain, none, _ = _serve_then_apply(d, latest, 1.0, monkeypatch)
    paced, asked, spent = _serve_then_apply(d, latest, 0.2, monkeypatch)
    assert [s for _, s in none if s > 0] == []       # share 1: no pauses
    # behind by several versions: only the newest is paced, after the others applied
    assert {before for before, _ in asked} == {latest - 2}
    pauses = [s for _, s in asked]
    assert len(pauses) >= 4      # its pages, around the overlay, before each chunk of rows
    # 4 s of pause per second of work at a share of 0.2: the pieces are most of the time
    # its apply took (time.sleep returned at once)
    assert 4 * 0.5 * spent <= sum(pauses) <= 4 * spent
    assert plain.keys() == paced.keys()
    for name in plain:
        np.testing.assert_array_equal(paced[name][0], plain[name][0])
        np.testing.assert_array_equal(paced[name][1], plain[name][1])


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(published, share, capsys):
    d, _ = published
    with pytest.raises(ValueError, match=r"apply_share must be in \(0, 1\]"):
        ServedModel(d, apply_share=share)
    assert cli.main([d, "--apply-share", str(share)]) == 2
    assert "--apply-share must be in (0, 1]" in capsys.readouterr().err
