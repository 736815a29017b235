"""Likely causes a new user's own engine (a trial: one bug planted per run) showed naming a
cause its findings did not show: positions a prefill never wrote, copied by a later
copy-on-write, read as a write through a stale table; a write after free that a wrong slot
formula explains read as an abort racing a step; a prefix hit that found a block's K/V
changed since its publication read as one that found it blank."""

from __future__ import annotations

import pytest
import torch

from kvscope.allocator import KVPool
from kvscope.analysis import analyze_view, likely_causes
from kvscope.kernels import copy_blocks
from tests.scenarios import published_before_written

GUARD = {"block_size": 4, "slots_per_block": 5}
STALE = "K/V written through a block table from before pool.append"
COPIED_BLANK = "copy-on-write copies of positions never written in their source"
NEVER = "positions never written in blocks that no copy-on-write, preemption or prefix hit"
RACED = "K/V written into blocks after their own request was aborted"


def _ev(op, block, gen, t, request, arg=0):
    return {
        "op": op,
        "block": block,
        "generation": gen,
        "time_ns": t,
        "request": request,
        "arg": arg,
        "pid": 7,
    }


def _unwritten(request, block, lo, hi, events, site="engine.py:89 admit", **extra):
    return {
        "kind": "kv_never_written",
        "block": block,
        "request": request,
        "message": (
            f"request {request!r} finished with positions {lo}-{hi} ({hi - lo + 1} slot(s)) of"
            " this block never written: a copy-on-write copy skipped, or K/V written through a"
            " stale table"
        ),
        "time_ns": max((e["time_ns"] for e in events), default=0),
        "site": site,
        "events": events,
        **extra,
    }


def _lost_and_written(writer: str, block: int, holder: str) -> dict:
    """`writer`'s store into `block`, which a preemption took from it and `holder` holds now
    (the store probe's unmapped_write, the block's events up to it)."""
    return {
        "kind": "unmapped_write",
        "block": block,
        "request": writer,
        "message": f"request {writer!r} stored K/V into block {block} at e.py:9 store, which it"
        f" does not map (held by request {holder!r}, pid 7)",
        "time_ns": 9,
        "events": [
            _ev("allocate", block, 1, 1, writer),
            _ev("preempt", block, 1, 2, writer),
            _ev("free", block, 1, 3, writer),
            _ev("allocate", block, 2, 4, holder),
            _ev("finding", block, 2, 9, writer),
        ],
    }


def _copy_and_source() -> list[dict]:
    """'w2' forked (its two samples share the id) with position 14 of its prompt's last
    block 35 never written; the first sample's append copied block 35 into 49, and both
    finished with position 14 unwritten (the trial's bug 5b)."""
    source = _unwritten(
        "w2",
        35,
        14,
        14,
        [
            _ev("allocate", 35, 1, 10, "w2", 13),
            _ev("fork", 35, 1, 11, "w2", 13),
            _ev("cow", 35, 1, 12, "w2", 49),
            _ev("finding", 35, 1, 30, "w2"),
            _ev("free", 35, 1, 31, "w2"),
        ],
    )
    copy = _unwritten(
        "w2",
        49,
        14,
        14,
        [_ev("allocate", 49, 1, 12, "w2", 13), _ev("finding", 49, 1, 29, "w2")],
        site="engine.py:109 decode",
        copied_from=35,
    )
    return [copy, source]


def _alone(request, block, pos, t):
    """A request that nobody forked or copied finished with `pos` never written."""
    return _unwritten(
        request,
        block,
        pos,
        pos,
        [
            _ev("allocate", block, 1, t, request, 1),
            _ev("publish", block, 1, t + 1, request),
            _ev("finding", block, 1, t + 2, request),
            _ev("free", block, 1, t + 3, request),
        ],
    )


def test_positions_a_prefill_never_wrote_in_a_copy_and_its_source_are_not_a_stale_table():
    # GIVEN the copy and its source unwritten at the same prompt position, and requests no
    # copy touched that finished with a position unwritten in blocks of the same site
    found = [*_copy_and_source(), _alone("r0", 3, 12, 40), _alone("r1", 7, 13, 50)]
    # WHEN the causes are named
    causes = likely_causes(GUARD, found)
    # THEN no stale table is blamed: the copy copied positions never written, and the
    # positions never written are named, with where their blocks were allocated
    assert not [c for c in causes if c.startswith(STALE)], causes
    (blank,) = [c for c in causes if c.startswith(COPIED_BLANK)]
    assert "'w2' block 49 copied from 35" in blank
    (never,) = [c for c in causes if c.startswith(NEVER)]
    assert "'r0' block 3 position 12, 'r1' block 7 position 13" in never
    assert "all in blocks allocated at engine.py:89 admit" in never
    assert "'w2'" not in never  # (its blocks are the copy's and its source: named above)


def test_a_copy_and_its_source_unwritten_alone_stay_a_stale_table_and_one_request_is_no_cause():
    # GIVEN only the copy and its source (a sibling's new token written through another
    # table leaves both so), or one other request unwritten besides
    assert [c[: len(STALE)] for c in likely_causes(GUARD, _copy_and_source())] == [STALE]
    one = likely_causes(GUARD, [*_copy_and_source(), _alone("r0", 3, 12, 40)])
    assert [c[: len(STALE)] for c in one] == [STALE]
    # AND with K/V found landing somewhere (a write after free), the unwritten positions
    # may be those writes': no cause says they were never stored
    landed = {
        "kind": "use_after_free",
        "block": 9,
        "request": "x",
        "message": "written after it was freed: ...",
        "events": [],
    }
    two = [_alone("r0", 3, 12, 40), _alone("r1", 7, 13, 50)]
    assert not [c for c in likely_causes(GUARD, [*two, landed]) if c.startswith(NEVER)]
    # AND a bare kv_never_written (no events, no positions) names nothing
    bare = [{"kind": "kv_never_written", "message": "", "request": r, "block": 1} for r in "ab"]
    assert likely_causes(GUARD, bare) == []


def _write(pool, seq, start, end):
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    flat[:, :, pool.slot_mapping(seq, start, end)] = 1.0


def test_a_prefill_one_position_short_with_a_forked_request_names_the_short_write(
    probes, make_pool
):
    # GIVEN an engine whose prefill stores one position too few (the last prompt position's
    # K/V never written), two plain requests and one with two samples (forked, same id), each
    # decode step's copy made and its token stored through the table re-read after append
    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4, guard=True)
    made = []
    for rid, prompt in (("a", range(1, 8)), ("b", range(20, 27)), ("p", range(40, 47))):
        seq = pool.allocate(rid, list(prompt))
        _write(pool, seq, 0, len(seq.tokens) - 1)  # the bug: one short
        pool.mark_computed(seq, len(seq.tokens))
        seqs = [seq] + ([pool.fork(seq, rid)] if rid == "p" else [])
        for i, s in enumerate(seqs):
            pos = len(s.tokens)
            for src, dst in pool.append(s, [90 + i]):
                copy_blocks(pool.kv, torch.tensor([src]), torch.tensor([dst]), pool=pool)
                made.append((src, dst))
            _write(pool, s, pos, pos + 1)
        for s in seqs:
            pool.free(s)
    ((src, dst),) = made
    # WHEN analyzed
    report = analyze_view(pool.view)
    # THEN each request left position 6 unwritten; the copy is not blamed on a stale table
    unwritten = [f for f in report["findings"] if f["kind"] == "kv_never_written"]
    assert {f["request"] for f in unwritten} == {"a", "b", "p"}
    assert all("finished with position 6 of this block" in f["message"] for f in unwritten)
    causes = report["likely_causes"]
    assert not [c for c in causes if c.startswith(STALE)], causes
    (blank,) = [c for c in causes if c.startswith(COPIED_BLANK)]
    assert f"'p' block {dst} copied from {src}" in blank
    (never,) = [c for c in causes if c.startswith(NEVER)]
    assert "'a' block" in never and "'b' block" in never and "position 6" in never


def _freed_by_poison(request, block, release):
    """A write after free found as poison overwritten at the block's next allocation (no
    writer known), its block last released by `release` of `request`."""
    return {
        "kind": "use_after_free",
        "block": block,
        "request": request,
        "message": (
            f"written after it was freed: pid 7 request {request!r} freed it at 2026-12-03"
            " 22:22:47.461, and 512 element(s) of its poison (NaN) were overwritten in quarantine"
        ),
        "time_ns": 50,
        "events": [
            _ev("allocate", block, 1, 10, request, 6),
            _ev(release, block, 1, 20, request),
            _ev("finding", block, 2, 50, request),
            _ev("allocate", block, 2, 51, "later", 9),
        ],
    }


def test_a_write_after_an_abort_that_stray_writes_explain_is_not_an_abort_race():
    aborted = _freed_by_poison("r4", 34, "abort")
    # GIVEN a write after free found in a block its request aborted, and nothing else: the
    # abort racing a step stays the cause (no writer known, nothing else explains it)
    (alone,) = likely_causes(GUARD, [aborted])
    assert alone.startswith(RACED) and "'r4' block 34" in alone
    # WHEN slots are worked out with block_size in guard mode (guard slots overwritten, mapped
    # slots left unwritten), the trial's bug 8: such stray writes land in any freed block
    guard = {"kind": "guard_violation", "block": 5, "request": "r1", "message": ""}
    never = {"kind": "kv_never_written", "block": 6, "request": "r1", "message": ""}
    causes = likely_causes(GUARD, [aborted, guard, never])
    # THEN the abort is not named: the slot formula is
    assert causes and causes[0].startswith("guard slots overwritten and mapped slots left")
    assert not [c for c in causes if c.startswith(RACED)], causes
    # AND WHEN other writes after free landed in blocks their request freed (no abort)
    freed = [_freed_by_poison(f"r{i}", 40 + i, "free") for i in range(3)]
    assert not [c for c in likely_causes(GUARD, [aborted, *freed]) if c.startswith(RACED)]
    # AND a store the store probe names, by another request than the one aborted, is not it
    other = dict(
        aborted,
        request="x",
        message="request 'x' stored K/V into block 34 at e.py:1 f: the block is free"
        " (last held by request 'r4', pid 7)",
    )
    assert likely_causes(GUARD, [other]) == []


def test_a_hit_that_found_a_blank_publication_changed_did_not_read_it_blank(probes, make_pool):
    # GIVEN an engine that publishes a prompt before writing its K/V: "reader" hits the blank
    # block, then the publisher writes it, "r1"'s hit finds the change, and a second handle's
    # "w0" hit finds it again (that handle's own report)
    pool = make_pool(32)
    seq, reader, blk = published_before_written(pool)
    r1 = pool.allocate("r1", list(range(8)) + [80])
    other = KVPool.attach(pool.name)
    try:
        w0 = other.allocate("w0", list(range(8)) + [90])
        report = analyze_view(pool.view)
        other.free(w0)
    finally:
        other.close()
    # WHEN analyzed, THEN the finding of the blank publication names only "reader" as a
    # request that read it blank: "r1" and "w0" read it changed (the finding says so)
    blank = [
        f
        for f in report["findings"]
        if f["kind"] == "published_block_modified" and f["block"] == blk
    ]
    # (one change two handles saw: one finding naming both hits)
    (change,) = blank
    assert change["seen_at"] == [
        "a prefix hit by request 'r1'",
        "a prefix hit by request 'w0'",
    ], change["message"]
    assert all(f["read_unwritten"] == ["reader"] for f in blank)
    assert all(f["first_bad_event"]["request"] == "reader" for f in blank)
    for s in (r1, reader, seq):
        pool.free(s)


@pytest.mark.parametrize("pattern", ["late", "opened", "ranges"])
def test_single_positions_unwritten_at_block_starts_name_the_decode_slot(pattern):
    # GIVEN kv_never_written findings of block size 4: one position each at the first slot of
    # a block two requests' appends opened, with (late) or without (opened) each request's
    # first decode position unwritten too inside its block; or ranges of several positions
    geometry = {"block_size": 4, "slots_per_block": 4}

    def unwritten(request, block, lo, hi, **extra):
        return _unwritten(request, block, lo, hi, [_ev("allocate", block, 1, 1, request)], **extra)

    if pattern == "ranges":
        findings = [unwritten("a", 1, 4, 6), unwritten("b", 3, 8, 9)]
    else:
        findings = [unwritten("a", 2, 8, 8), unwritten("b", 5, 12, 12)]
    if pattern == "late":
        findings += [unwritten("a", 1, 6, 6), unwritten("b", 4, 9, 9)]
    # and a forked sample's copy-on-write copy with its first decode position unwritten
    findings.append(unwritten("c", 7, 13, 13, copied_from=6))
    # WHEN the causes are worked out
    every = likely_causes(geometry, findings)
    causes = [c for c in every if c.startswith("positions never written, each")]
    # THEN single positions at block starts name the decode's slot: one position late where
    # the first decode positions are unwritten too, else a slot from before the append
    # (ranges of two requests are a write range that stops short; the block openers and the
    # first decode positions one late leaves unwritten are not named as that too)
    assert any(c.startswith(NEVER) for c in every) is (pattern == "ranges")
    if pattern == "ranges":
        assert causes == []
        return
    (cause,) = causes
    assert "'a' block 2 position 8" in cause and "'b' block 5 position 12" in cause
    assert ("one position late" in cause) is (pattern == "late")
    assert ("before pool.append gave the position its block" in cause) is (pattern == "opened")
    # and the copy's one unwritten position is the late store's where it is one position late
    # (a forked sample's first decode), else the stale table's (its own cause)
    late = pattern == "late"
    assert ("'c' block 7 copied from 6" in cause) is late
    assert any(c.startswith(STALE) for c in every) is not late


def test_beside_the_slot_formula_no_other_cause_of_unwritten_positions_is_named():
    # GIVEN the slot formula's signature (guard slots overwritten, mapped slots unwritten) and,
    # from the same formula, unwritten positions in a copy-on-write copy, in a resumed
    # request's block, and in a published block prefix hits read, and a write into a block
    # lost to a preemption
    cow = [_ev("cow", 19, 1, 5, "r21", arg=30)]
    found = [
        {"kind": "guard_violation", "block": 4, "request": "r1", "message": "guard slot ..."},
        _unwritten("r2", 7, 0, 3, [_ev("allocate", 7, 1, 1, "r2")]),
        _unwritten("r21", 19, 1, 1, cow, copied_from=30),
        _unwritten("r9", 22, 0, 3, [_ev("allocate", 22, 2, 9, "r9")], preempted_blocks=[1, 12]),
        _unwritten("r9", 27, 0, 3, [_ev("allocate", 27, 1, 2, "r9")], read_unwritten=["r9/s1"]),
        # and a stray write into a block its writer had lost to a preemption
        _lost_and_written("r18", 17, "r3"),
    ]
    # WHEN the causes are named
    causes = likely_causes(GUARD, found)
    # THEN the formula is the one cause; each of the others alone names its own
    (cause,) = causes
    assert "block * block_size + offset" in cause
    for other in found[2:]:
        assert likely_causes(GUARD, [other]), other


@pytest.mark.parametrize("held_before", [False, True])
def test_a_store_into_a_block_its_writer_never_held_names_another_table_s_row(held_before):
    # GIVEN a decode step's store that the store probe names into a block another request
    # holds ('n' wrote into 'h''s block 17), its writer's own position left unwritten
    events = [_ev("allocate", 17, 1, 1, "h"), _ev("publish", 17, 1, 2, "h")]
    if held_before:  # (the writer held the block once: a table kept from then, not a row)
        events.insert(0, _ev("allocate", 17, 1, 0, "n"))
    stray = {
        "kind": "unmapped_write",
        "block": 17,
        "request": "n",
        "message": "request 'n' stored K/V into block 17 at e.py:9 store, which it does not map"
        " (held by request 'h', pid 7)",
        "time_ns": 3,
        "events": [*events, _ev("finding", 17, 1, 3, "n")],
    }
    own = _unwritten("n", 30, 16, 16, [_ev("allocate", 30, 1, 2, "n")])
    # ... and its store into a block it held before a preemption, another request's now
    lost = dict(
        stray,
        block=22,
        message=stray["message"].replace("block 17", "block 22"),
        events=[
            _ev("allocate", 22, 1, 0, "n"),
            _ev("preempt", 22, 1, 1, "n"),
            _ev("free", 22, 1, 1, "n"),
            _ev("allocate", 22, 2, 2, "h"),
            _ev("finding", 22, 2, 3, "n"),
        ],
    )
    # WHEN the causes are named
    causes = likely_causes(GUARD, [stray, own, lost])
    named = [c for c in causes if c.startswith("K/V stored into blocks their writer never held")]
    if held_before:
        assert named == []
        return
    # THEN the write names another sequence's table row, and the unwritten position and the
    # write into the block lost to the preemption (another row's block) are its consequences,
    # not causes of their own
    assert causes == named and "('n' into block 17)" in named[0]
    assert "pool.slot_mapping(seq, start, end)" in named[0]


@pytest.mark.parametrize("end", ["abort", "free", "abandoned"])
def test_a_store_after_an_abort_into_the_block_another_request_took_names_the_abort(end):
    # GIVEN request 'r3' aborted (or freed, or abandoned by the core: its resume ran short),
    # its block 30 taken since by 'r2' in another process, and the store probe naming 'r3' as
    # the writer into it
    events = [
        _ev("allocate", 30, 1, 1, "r3"),
        _ev("abort", 30, 1, 2, "r3", arg=1) if end == "abandoned" else _ev(end, 30, 1, 2, "r3"),
        dict(_ev("allocate", 30, 2, 3, "r2"), pid=8),
        _ev("finding", 30, 2, 4, "r3"),
    ]
    stray = {
        "kind": "unmapped_write",
        "block": 30,
        "request": "r3",
        "message": "request 'r3' stored K/V into block 30 at e.py:9 store, which it does not map"
        " (held by request 'r2', pid 8)",
        "time_ns": 4,
        "events": events,
    }
    # WHEN the causes are named
    causes = likely_causes(GUARD, [stray])
    # THEN after the program's abort it is the abort racing the step; after a free or the
    # core's abandon, not
    raced = [c for c in causes if c.startswith(RACED)]
    if end == "abort":
        (cause,) = raced
        assert "('r3' block 30)" in cause
    else:
        assert raced == []


def test_a_block_found_twice_after_an_abort_is_named_once():
    # GIVEN one write after an abort found twice: at the store, naming its writer, and later
    # as the poison it overwrote
    events = [_ev("allocate", 13, 1, 1, "r1"), _ev("abort", 13, 1, 2, "r1")]
    stored = {
        "kind": "use_after_free",
        "block": 13,
        "request": "r1",
        "message": "request 'r1' stored K/V into block 13 at e.py:9 store: the block is free"
        " (last held by request 'r1', pid 7)",
        "time_ns": 3,
        "events": events,
    }
    # WHEN the causes are named
    (cause,) = likely_causes(GUARD, [stored, dict(stored, time_ns=4)])
    # THEN the block is named once
    assert "('r1' block 13)" in cause


def test_the_recorder_holds_a_writers_whole_life_only_from_its_first_allocation(pool_name):
    from kvscope.allocator import KVPool, PoolConfig
    from kvscope.analysis import writer_recorded_whole

    # GIVEN a flight recorder of 16 events that wraps: 'old' allocated before it wrapped, 'res'
    # preempted before it wrapped and resumed after, 'fresh' allocated after
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                   dtype="float32", events=True, event_capacity=16, local_cache_size=0),
    )  # fmt: skip
    try:
        pool.allocate("old", list(range(8)))
        res = pool.allocate("res", list(range(100, 108)))
        pool.set_state(res, "waiting")
        hogs = [
            pool.allocate(r, list(range(k, k + n))) for r, k, n in (("h1", 200, 16), ("h2", 300, 8))
        ]
        assert res.state == "preempted"
        for h in hogs:
            pool.free(h)
        for i in range(10):
            pool.free(pool.allocate(f"f{i}", [1000 + i]))
        pool.resume(res)
        pool.allocate("fresh", [5000, 5001])
        # WHEN asked whether the recorder holds each one's whole life THEN only the request
        # whose first allocation it still holds: not one whose allocation it lost, nor one
        # whose oldest event left is its resume's (a prefix_hit with arg 1)
        now = 1 << 62
        whole = {w: writer_recorded_whole(pool.view, w, now) for w in ("old", "res", "fresh")}
        assert whole == {"old": False, "res": False, "fresh": True}
    finally:
        pool.close()
        pool.unlink()


def test_a_store_whose_writers_older_events_are_lost_is_not_said_never_held():
    # GIVEN a store the store probe named into another request's block, whose writer the
    # recorder shows no operation of on that block, but whose older events it lost
    stray = {
        "kind": "unmapped_write",
        "message": "request 'n' stored K/V into block 17 at e.py:9 step: it does not map it",
        "block": 17,
        "request": "n",
        "time_ns": 9,
        "stores": {"writer": "n"},
        "events": [_ev("allocate", 17, 2, 2, "h"), _ev("finding", 17, 2, 3, "n")],
        "writer_recorded_whole": False,
    }
    # WHEN the causes are named THEN not "never held": either table could have been used
    causes = likely_causes(GUARD, [stray])
    assert not [c for c in causes if "never held" in c], causes
    (unseen,) = [c for c in causes if "no operation of their writer" in c]
    assert "('n' into block 17)" in unseen and "KVSCOPE_EVENT_CAPACITY" in unseen
    # AND with the whole life recorded, never held
    whole = dict(stray, writer_recorded_whole=True)
    assert [c for c in likely_causes(GUARD, [whole]) if "never held" in c]


def test_a_preempted_request_writing_into_a_block_it_hit_is_the_stale_table_not_a_prompt_rewrite():
    # GIVEN request 'r131', preempted and resumed, storing through its table from before the
    # preemption: once into block 7, which the preemption took from it and 'r100' holds now,
    # and once into block 9, published by 'r117', which its resume maps by a prefix hit (the
    # trial's stale-resume bug)
    lost = _lost_and_written("r131", 7, "r100")
    hit = {
        "kind": "published_block_modified",
        "block": 9,
        "request": "r131",  # (the store's writer)
        "message": "request 'r131' stored K/V into block 9 at e.py:92 write_kv: published by"
        " request 'r117' (pid 7), shared by prefix hits",
        "time_ns": 12,
        "events": [
            _ev("allocate", 9, 13, 5, "r117"),
            _ev("publish", 9, 13, 6, "r117"),
            _ev("prefix_hit", 9, 13, 7, "r131"),
            _ev("finding", 9, 13, 12, "r131"),
        ],
    }
    # WHEN the causes are named
    causes = likely_causes(GUARD, [lost, hit])
    # THEN the one cause is the table kept across the preemption, naming both of its requests'
    # blocks; the hit block alone is still a prompt stored from position 0
    (cause,) = causes
    assert cause.startswith("K/V written into blocks their request had lost to a preemption")
    assert "'r131' block 7" in cause
    (alone,) = likely_causes(GUARD, [hit])
    assert alone.startswith("published prefix blocks written by requests that hit them")


@pytest.mark.parametrize("left_unwritten", [True, False])
def test_a_request_storing_into_its_own_published_prefix_while_leaving_later_positions_unwritten(
    left_unwritten,
):
    # GIVEN request 'r100''s store into block 0, which it published itself (its prompt's first
    # block), and, with `left_unwritten`, its own block 4 (positions 64-79, a later chunk)
    # finished never written: a chunked prefill storing each chunk from position 0
    own = {
        "kind": "published_block_modified",
        "block": 0,
        "request": "r100",
        "message": "request 'r100' stored K/V into block 0 at e.py:92 write_kv: published by"
        " request 'r100' (pid 7), shared by prefix hits",
        "time_ns": 9,
        "mapped_since_published": [],
        "events": [
            _ev("allocate", 0, 1, 1, "r100"),
            _ev("publish", 0, 1, 2, "r100"),
            _ev("finding", 0, 1, 9, "r100"),
        ],
    }
    found = [own]
    if left_unwritten:
        found.append(_unwritten("r100", 4, 64, 79, [_ev("allocate", 4, 1, 3, "r100")]))
    # WHEN the causes are named
    causes = likely_causes(GUARD, found)
    # THEN with its later positions unwritten, its K/V went to the earlier positions' slots
    # (named first); without them, the store came after the publication
    shifted = "requests that stored K/V into their own published prefix blocks ('r100' block 0)"
    assert causes[0].startswith(shifted) is left_unwritten, causes
    if left_unwritten:
        assert "left later positions of their own unwritten ('r100' block 4)" in causes[0]
        assert "pool.slot_mapping(seq, s, e)" in causes[0]
    assert any(c.startswith("published blocks whose K/V changed") for c in causes) is not (
        left_unwritten
    )
