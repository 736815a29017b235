"""A dead process's leak_dead_owner finding shows the events of that process on its block (what
it did last), not the hits and frees of the survivors sharing the block (a shared prefix
block's last events are theirs)."""

from __future__ import annotations

from tests.test_report_same_cause import _text


def _event(t, pid, op, request):
    return {
        "time_ns": t,
        "pid": pid,
        "op": op,
        "block": 0,
        "generation": 1,
        "arg": 0,
        "request": request,
    }


def test_a_dead_owner_shows_its_own_events_on_the_block():
    events = [_event(1, 5, "allocate", "mine")]
    events += [_event(2 + i, 6, "prefix_hit", f"theirs-{i}") for i in range(20)]
    finding = {
        "kind": "leak_dead_owner",
        "severity": "warning",
        "block": 0,
        "owner_pid": 5,
        "request": "mine",
        "message": "block is held by pid 5, which died",
        "source": "check",
        "events": events,
    }
    text = _text([finding])
    assert "last events of pid 5 (20 of other processes left out):" in text
    assert "request 'mine'" in text and "theirs-" not in text
    # another kind keeps every process's events
    text = _text([dict(finding, kind="leak_finished")])
    assert "theirs-19" in text and "of pid 5" not in text
