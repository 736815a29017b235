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


def test_one_request_s_blocks_allocated_at_several_lines_print_each_line_with_its_blocks():
    # GIVEN a dead process's request holding a shared prefix block another line allocated and
    # two blocks of its own
    def held(block, site):
        return {
            "kind": "leak_dead_owner",
            "severity": "warning",
            "block": block,
            "owner_pid": 5,
            "request": "r8",
            "message": "block is held by pid 5, which died",
            "source": "check",
            "site": site,
            "events": [],
        }

    found = [held(6, "e.py:466 main"), held(14, "e.py:268 append"), held(16, "e.py:268 append")]
    # WHEN the report groups them into one entry
    text = _text(found)
    # THEN each line is named with its blocks, not the first block's line for all
    assert "leak_dead_owner blocks 6, 14, 16 pid 5 request 'r8'" in text
    assert "allocated at e.py:466 main (block 6); e.py:268 append (blocks 14, 16)" in text
    # and one line alone is printed as before
    text = _text([held(14, "e.py:268 append"), held(16, "e.py:268 append")])
    assert "allocated at e.py:268 append\n" in text + "\n"
