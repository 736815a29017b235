"""The LEAK SUMMARY's numbers add up: a block several leaked requests share (a prompt prefix) is
one of the distinct blocks of its first line, and its last line says how the groups and the
requests' own leak_finished lines count it."""

from __future__ import annotations

from kvscope.probes import leaks


def test_blocks_shared_between_groups_are_said_so_the_summary_adds_up(make_pool, monkeypatch):
    # GIVEN three requests still held, sharing a 2-block prefix: 'a' created at one line,
    # 'b' and 'c' at another
    pool = make_pool(64)
    a = pool.allocate("a", list(range(8)))
    pool.mark_computed(a, 8)
    b = pool.allocate("b", [*range(8), 100, 101, 102, 103, 104])
    c = pool.allocate("c", [*range(8), 200, 201, 202, 203, 204])
    site = {a.slot: "x.py:1 f", b.slot: "y.py:2 g", c.slot: "y.py:2 g"}
    monkeypatch.setattr(leaks, "creation_site", lambda view, slot, function=False: site[slot])
    # WHEN their summary is made
    text = leaks.summary(pool, [a, b, c], "at exit")
    # THEN the first line counts the 6 distinct blocks, the groups 6 + 2 (the prefix in both),
    # and the last line says the 2 shared ones are counted in each group, and that the requests'
    # own lines (2 + 4 + 4 blocks) add up to 10
    lines = text.splitlines()
    assert "6 blocks (18 tokens of KV) in 3 request(s)" in lines[0], text
    assert lines[1].endswith("6 block(s) held by 2 request(s) created at y.py:2 g"), text
    assert lines[2].endswith("2 block(s) held by 1 request(s) created at x.py:1 f"), text
    assert "2 of them in more than one group above" in lines[3], text
    assert "leak_finished lines add up to 10" in lines[3], text


def test_requests_sharing_nothing_get_no_extra_line(make_pool):
    # GIVEN two requests that share no block
    pool = make_pool(64)
    a = pool.allocate("a", list(range(8)))
    b = pool.allocate("b", list(range(100, 105)))
    # WHEN their summary is made, THEN it is the header and one line per creation site
    text = leaks.summary(pool, [a, b], "at exit")
    assert len(text.splitlines()) == 2 and "counted once" not in text, text


def _allocate_here(pool, tokens):
    return pool.allocate("parked", tokens)


def _resume_here(pool, seq):
    return pool.resume(seq)


def test_a_resumed_request_is_named_after_the_call_that_created_it(make_pool, monkeypatch):
    # GIVEN sites recorded, a request allocated in one function, preempted, and resumed in
    # another
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(8, local_cache_size=0)
    seq = _allocate_here(pool, list(range(6)))
    pool.set_state(seq, "waiting")
    big = pool.allocate("big", list(range(100, 128)))  # (every block: preempts it)
    assert seq.state == "preempted"
    pool.free(big)
    _resume_here(pool, seq)
    # THEN it is still named after its allocate (its blocks taken now, after the resume)
    made = leaks.creation_site(pool.view, seq.slot, function=True)
    assert made is not None and made.endswith("_allocate_here"), made
    from kvscope.allocator.sites import site_frames

    frames = site_frames(pool.view, int(pool.view.blocks["site"][seq.block_table[0]]))
    assert frames and frames[0].endswith("_resume_here"), frames
    pool.free(seq)
