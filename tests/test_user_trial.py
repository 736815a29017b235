"""What a new user's own engine (tests/user_engine.py's kind, with bugs planted one at a time)
showed the report getting wrong: a resumed request's K/V written through its table from before
the preemption, which publishes its new blocks blank, is not an early publication; a probe's
finding event is not the first bad operation on a block."""

from __future__ import annotations

import os

import pytest

from kvscope.analysis import analyze_view, first_bad_event, likely_causes

GUARD = {"block_size": 4, "slots_per_block": 5}
BLANK = "published before its K/V was written: mark_computed digested an all-NaN (poison) block"


def _ev(op, gen, t, request="a"):
    return {"op": op, "generation": gen, "time_ns": t, "request": request, "block": 3}


def test_a_finding_recorded_on_a_released_generation_is_not_the_first_bad_event():
    # GIVEN a block published, released (cached), handed out again, and a probe's finding
    # recorded about the generation it had before (a digest change seen at its eviction)
    events = [
        _ev("allocate", 1, 1),
        _ev("publish", 1, 2),
        _ev("free", 1, 3),
        _ev("allocate", 2, 4, "b"),
        _ev("finding", 1, 5, "c"),
        _ev("guard_violation", 1, 6, "c"),
    ]
    # THEN no operation went wrong: the finding is what was seen, not what the program did
    assert first_bad_event(events, 2) is None
    # AND a release of the released generation still is the first bad event
    twice = [*events, _ev("free", 1, 7)]
    assert first_bad_event(twice, 2) == twice[-1]


def _findings(landed: bool) -> list[dict]:
    """A request 'a' that published block 5 blank right after its resume, its preemption having
    released blocks 1 and 2; a prefix hit of 'b' that read block 5 changed since; with `landed`,
    K/V that changed since in block 1, which 'a' held before its preemption."""
    found = [
        {
            "kind": "published_block_modified",
            "block": 5,
            "request": "a",
            "message": BLANK + ", and its K/V changed since",
            "preempted_blocks": [1, 2],
        },
        {
            "kind": "foreign_slot",
            "block": 5,
            "request": "b",
            "message": "a prefix hit: slot 0 of block 5 ... was written since its publication",
        },
    ]
    if landed:
        found.append(
            {
                "kind": "published_block_modified",
                "block": 1,
                "request": "x",
                "message": "K/V changed since request 'x' published it",
            }
        )
    return found


@pytest.mark.parametrize("landed", [True, False])
def test_a_blank_publication_after_a_resume_names_the_stale_table(landed):
    causes = likely_causes(GUARD, _findings(landed))
    if landed:
        # THEN the resume is the cause, not an early publication
        (cause,) = causes
        assert cause.startswith("requests preempted and resumed")
        assert "'a' block 5" in cause and "mark_computed found them blank" in cause
        assert "block 1" in cause
    else:
        # THEN without a write into a block it lost, an early publication stays the cause
        (cause,) = causes
        assert cause.startswith("blocks published before their K/V was written ('a' block 5)")


def _write(pool, table, start, end, tokens):
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    spb, bs = pool.slots_per_block, pool.block_size
    for p in range(start, end):
        flat[:, :, table[p // bs] * spb + p % bs] = float(tokens[p])


@pytest.mark.parametrize("found_between", [False, True])
def test_a_resumed_request_publishing_blank_blocks_carries_its_preemption(
    probes, make_pool, found_between
):
    # GIVEN a request computed and published, preempted, its blocks evicted, then resumed
    # (with, in between, a finding in its name: its store through the old table, checked)
    pool = make_pool(num_blocks=12, block_size=4, num_kv_heads=1, head_dim=4, guard=True)
    prompt = list(range(1, 9))
    a = pool.allocate("a", prompt)
    _write(pool, a.block_table, 0, 8, prompt)
    pool.mark_computed(a, 8)
    old = list(a.block_table)
    pool.set_state(a, "waiting")
    b = pool.allocate("b", list(range(100, 148)))  # every block: a preempted, evicted
    assert a.state == "preempted"
    pool.free(b)
    if found_between:
        import torch

        from kvscope.kernels import store_kv
        from kvscope.probes.stores import Writers

        kv = torch.ones(1, 1, 4)
        slot = torch.tensor([old[0] * pool.slots_per_block])
        store_kv(kv, kv, pool.kv[0, 0], pool.kv[0, 1], slot, writers=Writers(pool, [(a, 0, 1)]))
        assert any(f.request == "a" for f in pool.findings())
    assert pool.resume(a) == 0
    new = list(a.block_table)
    assert not set(new) & set(old)
    # WHEN its engine writes through the table from before the preemption, publishes the new
    # blocks (blank), and K/V lands in them later (another request's stale table)
    _write(pool, old, 0, 8, prompt)
    pool.mark_computed(a, 8)
    _write(pool, new, 0, 8, [t + 50 for t in prompt])
    pool.free(a)
    report = analyze_view(pool.view)
    # THEN the blank publications carry the blocks the preemption released
    blank = [
        f
        for f in report["findings"]
        if f["kind"] == "published_block_modified" and f["message"].startswith(BLANK[:30])
    ]
    assert blank and all(f["request"] == "a" for f in blank)
    assert all(set(f["preempted_blocks"]) == set(old) for f in blank)


@pytest.mark.parametrize("second", ["reused", "fork", "after_free"])
def test_a_request_id_reused_while_live_is_named_as_the_leak_cause(probes, make_pool, second):
    from kvscope.child import report_held

    # GIVEN request 7 allocated (an int id) and, while it holds its blocks, a second sequence
    # with the id 7: a new request given the same id (the bug), a fork of it (by design), or
    # a new request after the first was freed
    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4)
    first = pool.allocate(7, (1, 2, 3, 4, 5))
    if second == "after_free":
        pool.free(first)
    if second == "fork":
        kid = pool.fork(first, 7)
        pool.append(kid, [9, 9, 9, 9])  # its own new blocks, allocated under the id
        pool.free(kid)
    else:
        again = pool.allocate(7, (20, 21, 22, 23, 24, 25))
        pool.free(again)
    if second == "after_free":
        leaked = pool.allocate(8, (1, 2, 3))  # a leak that no reuse explains
    # WHEN the process ends with the first (or another) request still held
    report_held(pool, "the pool was closed")
    report = analyze_view(pool.view)
    leaks = [f for f in report["findings"] if f["kind"] == "leak_finished"]
    assert len(leaks) == 1
    causes = report.get("likely_causes", [])
    # THEN only the reuse while live names the reuse as the cause, with both sequences
    if second == "reused":
        assert leaks[0]["request"] == "7"
        (r,) = leaks[0]["id_reused_while_live"]
        assert (r["seq_id"], r["reused_by"]) == (first.seq_id, [again.seq_id])
        (cause,) = causes
        assert cause.startswith("request ids reused while their request still held its blocks")
        assert f"'7': sequence {first.seq_id} still held" in cause
        assert f"when sequence {again.seq_id} was allocated" in cause
    else:
        assert "id_reused_while_live" not in leaks[0] and not causes
    if second == "after_free":
        pool.free(leaked)
    else:
        pool.free(first)


@pytest.mark.parametrize("past", [True, False])
def test_a_write_one_past_the_sequence_end_is_named(probes, make_pool, past):
    # GIVEN a prompt of two full blocks whose prefill stores one position more than it has
    pool = make_pool(num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4, guard=True)
    prompt = list(range(1, 9))
    a = pool.allocate("a", prompt)
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    slots = pool.slot_mapping(a, 0, 8)
    for p, slot in enumerate(slots):
        flat[:, :, slot] = float(prompt[p])
    if past:
        flat[:, :, slots[-1] + 1] = 0.5  # the bug: position 8, one past the end
    pool.mark_computed(a, 8)
    pool.verify()  # (the check the core runs every 10 ms of operations; here, now)
    pool.free(a)
    report = analyze_view(pool.view)
    causes = report.get("likely_causes", [])
    if not past:
        assert not report["findings"] and not causes
        return
    # THEN the guard violation on its last block is named as a write one past the end
    (f,) = [f for f in report["findings"] if f["kind"] == "guard_violation"]
    assert (f["request"], f["block"]) == ("a", a_last := slots[-1] // pool.slots_per_block)
    (cause,) = causes
    assert cause.startswith("guard slots overwritten, and no mapped slot left unwritten")
    assert f"'a' block {a_last}" in cause and "one position past the sequence's end" in cause


@pytest.mark.parametrize("served", [False, True, "reused"])
def test_a_leak_the_engine_stopped_serving_is_named(probes, make_pool, served):
    from kvscope.child import report_held

    # GIVEN request 'a' admitted, then requests 'b' and 'c' served start to end, and 'a'
    # either left alone from then on (the engine dropped it: the bug) or served to the end,
    # or its id given to a second sequence that ended (which operations were the leaked one's
    # is then not known)
    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", (1, 2, 3, 4, 5))
    if served == "reused":
        pool.free(pool.fork(a, "a"))
    for rid, base in (("b", 10), ("c", 20)):
        s = pool.allocate(rid, tuple(range(base, base + 6)))
        pool.append(s, [base + 7])
        pool.free(s)
    if served is True:
        pool.append(a, [6, 7, 8, 9])  # its own new block: an operation after theirs
    # WHEN the pool is closed with 'a' still held
    report_held(pool, "the pool was closed")
    report = analyze_view(pool.view)
    (leak,) = [f for f in report["findings"] if f["kind"] == "leak_finished"]
    causes = report.get("likely_causes", [])
    # THEN only the dropped request is named as one the engine stopped serving
    if served:
        assert "served_after" not in leak and not causes
    else:
        assert leak["served_after"]["requests"] == ["b", "c"]
        (cause,) = causes
        assert cause.startswith("leaked requests the engine stopped serving long before the end")
        assert (
            "'a', last recorded event: allocate, then 2 other request(s) began and ended" in cause
        )
    pool.free(a)


@pytest.mark.parametrize("failed", [False, True])
def test_a_leak_in_a_program_that_failed_is_named_by_the_failure(
    probes, make_pool, tmp_path, failed
):
    import os

    from kvscope.allocator.dumpfile import write_dump
    from kvscope.allocator.dumpread import read_dump, read_dump_header
    from kvscope.child import report_held

    # GIVEN request 'a' admitted and 'b' served start to end after it, then the pool closed
    # with 'a' still held, and a dump of it about this process, which failed (an exception
    # ended it while 'a' was decoding: appends within a block leave no event) or ended well
    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", (1, 2, 3, 4, 5))
    b = pool.allocate("b", (10, 11, 12))
    pool.free(b)
    report_held(pool, "the pool was closed")
    how = f"child pid {os.getpid()} raised KeyError: 14 (engine.py:50 in store)"
    path = write_dump(
        pool, tmp_path / "p.kvd", reason=f"{how}; blocks leaked", pid=os.getpid(), failed=failed
    )
    pool.free(a)
    # WHEN the dump is analyzed
    view, header = read_dump(path)
    assert int(read_dump_header(path)["flags"]) == int(header["flags"])
    report = analyze_view(view, dump_header=header)
    # THEN the dump says whether its program failed, and a failed program's leak is named by
    # its failure, not as a request its scheduler dropped
    assert report["pool"]["dump"]["failed"] is failed
    (leak,) = [f for f in report["findings"] if f["kind"] == "leak_finished"]
    assert leak["served_after"]["requests"] == ["b"]
    (cause,) = report["likely_causes"]
    if failed:
        assert cause.startswith(f"requests the program still held when it failed ('a'; {how})")
        assert "release the sequences on the error path" in cause
    else:
        assert cause.startswith("leaked requests the engine stopped serving long before the end")


def _admit(pool, rid, prompt):
    """The one allocation site of this test's requests (as an engine's admit is)."""
    return pool.allocate(rid, prompt)


def test_a_finding_whose_block_was_handed_out_again_shows_no_later_life_as_its_own(
    probes, make_pool
):
    from kvscope.report import console, render

    # GIVEN request 'a' publishing its block before writing its K/V (a finding at its release),
    # then the block handed out again at the same line, and the flight recorder (16 events a
    # process) turned over by later requests
    pool = make_pool(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4, event_capacity=16)
    a = _admit(pool, "a", (1, 2, 3, 4, 5))
    pool.mark_computed(a, 5)
    _write(pool, a.block_table, 0, 5, a.tokens)
    blk = a.block_table[0]
    pool.free(a)
    found = [f for f in pool.findings() if f.kind == "published_block_modified"]
    assert [f.block for f in found] == [blk]
    pool.evict(4)
    for i in range(12):
        s = _admit(pool, f"r{i}", (100 + i, *[1] * 12))  # every block
        pool.free(s)
    assert pool.view.blocks["alloc_ns"][blk] > found[0].to_dict()["extra"]["time_ns"]
    # WHEN analyzed
    report = analyze_view(pool.view)
    (f,) = [f for f in report["findings"] if f["kind"] == "published_block_modified"]
    # THEN the allocation shown is not the later one's time, and the text says that the events
    # the recorder holds all came after the finding instead of listing them as its own
    assert f.get("alloc_ns", 0) <= f["time_ns"]
    assert f["events"] and all(e["time_ns"] > f["time_ns"] for e in f["events"])
    import io

    out = io.StringIO()
    render(report, console(out))
    text = out.getvalue()
    assert "no event up to the finding left in the flight recorder" in text
    assert "_admit" in text


@pytest.mark.parametrize("leak", [True, False])
def test_the_capacity_answer_says_when_leaked_blocks_filled_the_pool(make_pool, leak):
    from kvscope.allocator import KVPool, PoolExhausted
    from kvscope.capacity import capacity_answer

    # GIVEN a second handle that closes with a request still held (a leak) or freed, then an
    # allocation the pool cannot serve
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4, local_cache_size=0)
    other = KVPool.attach(pool.name)
    seq = other.allocate("leaked", tuple(range(1, 21)))  # 5 blocks
    other.mark_computed(seq, 20)
    # a request of this handle sharing the other's first two blocks (not stranded: mapped)
    hit = pool.allocate("hit", tuple(range(1, 9)) + (99,))
    assert hit.num_cached_tokens == 8
    if not leak:
        other.free(seq)
    other.close()
    held = pool.allocate("big", tuple(range(100, 108)) if leak else tuple(range(100, 116)))
    with pytest.raises(PoolExhausted):
        pool.allocate("more", tuple(range(200, 212)))
    # WHEN the capacity answer is read
    cap = capacity_answer(pool.view, None)
    # THEN it says first that the leaked blocks filled the pool (3 of 8: the answer, not the
    # pool's size), and only then
    if leak:
        assert cap["stranded_blocks"] == 3
        assert cap["answer"].startswith(
            "blocks stranded, not a pool too small: 3 of the pool's 8 blocks are held by no"
            " process holding the pool"
        )
        assert "Counting them as demand: " in cap["answer"]
    else:
        assert "stranded_blocks" not in cap and "no process holding" not in cap["answer"]
    pool.free(held)
    pool.free(hit)


@pytest.mark.parametrize("lost", [True, False])
def test_the_capacity_answer_says_when_lost_preempted_requests_were_demand(make_pool, lost):
    from kvscope.allocator import KVPool
    from kvscope.capacity import capacity_answer

    # GIVEN a second handle whose waiting request a larger one preempts, then the handle
    # closes with the preempted request neither resumed nor ended (lost) or freed
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4, local_cache_size=0)
    other = KVPool.attach(pool.name)
    waiting = other.allocate("waiting", tuple(range(1, 19)))  # 18 tokens: 5 blocks
    other.set_state(waiting, "waiting")
    big = other.allocate("big", tuple(range(100, 116)))  # 4 blocks: preempts the waiting one
    assert waiting.state == "preempted"
    other.free(big)
    if not lost:
        other.free(waiting)
    other.close()
    # WHEN the capacity answer is read
    cap = capacity_answer(pool.view, None)
    # THEN it says the lost request's blocks were counted as demand, and only then
    assert cap["num_preemptions"] == 1 and "stranded_blocks" not in cap
    if lost:
        assert cap["stranded_preempted"] == {"sequences": 1, "blocks": 5}
        assert cap["demand_now"] == 5
        assert (
            "1 preempted sequence of no process holding the pool, neither resumed nor ended,"
            " wanted 5 blocks back" in cap["answer"]
        )
    else:
        assert "stranded_preempted" not in cap and "no process holding" not in cap["answer"]


def test_block_and_request_focus_print_times_and_tables_as_text(make_pool, capsys):
    from kvscope.cli import main

    # GIVEN a live pool with an int request id's sequence
    pool = make_pool(num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
    seq = pool.allocate(3, tuple(range(1, 10)))
    blk = seq.block_table[0]
    # WHEN one block and one request are looked at
    main(["analyze", pool.name, "--block", str(blk)])
    block = capsys.readouterr().out
    main(["analyze", pool.name, "--request", "3"])
    request = capsys.readouterr().out
    # THEN times read as times, lists as their items, a sequence as one line (no Python repr)
    assert "alloc_ns: 20" in block and "mapped_by: '3'" in block and "request: '3'" in block
    table = ", ".join(map(str, seq.block_table))
    assert f"sequence: running, pid {pool.pid}, 9 tokens, blocks {table}" in request
    assert "[{" not in request and "['" not in block
    pool.free(seq)


@pytest.mark.parametrize("order", ["publish_then_store", "store_then_publish"])
def test_a_decode_step_publishing_before_its_store_is_named(probes, make_pool, order):
    # GIVEN a request whose decode step's new token fills its first block, published before
    # (the bug) or after that token's K/V is stored
    pool = make_pool(num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", (1, 2, 3))
    _write(pool, a.block_table, 0, 3, a.tokens)
    pool.mark_computed(a, 3)
    assert pool.append(a, [4]) == []
    if order == "publish_then_store":
        pool.mark_computed(a, 4)
    _write(pool, a.block_table, 3, 4, a.tokens)
    if order == "store_then_publish":
        pool.mark_computed(a, 4)
    pool.free(a)
    report = analyze_view(pool.view)
    causes = report.get("likely_causes", [])
    if order == "store_then_publish":
        assert not report["findings"] and not causes
        return
    # THEN the block's change since its publication, which nobody else mapped, is its
    # publisher's late store
    (f,) = report["findings"]
    assert f["kind"] == "published_block_modified" and f["mapped_since_published"] == []
    (cause,) = causes
    assert cause.startswith("published blocks whose K/V changed while no other request mapped")
    assert f"('a' block {f['block']})" in cause and "store the step's K/V first" in cause


@pytest.mark.slow
@pytest.mark.parametrize("holds", [True, False])
def test_a_worker_that_exits_without_closing_is_named_with_its_requests(make_pool, holds):
    from kvscope.allocator import KVPool
    from kvscope.supervisor import dead_owner
    from tests.forking import fork_child, wait_child

    # GIVEN a forked worker that attaches, allocates request 2099 (or frees it), and leaves
    # with os._exit without closing its handle
    pool = make_pool(num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)

    def work() -> int:
        mine = KVPool.attach(pool.name)
        seq = mine.allocate(2099, (1, 2, 3, 4, 5, 6))
        if not holds:
            mine.free(seq)
        return 0

    pid = fork_child(work, alarm_s=60)
    assert wait_child(pid) == 0
    # WHEN the supervisor says what it left
    said = dead_owner(pool.view, pid)
    # THEN the finding names its request and how such a process ends (with none held, the
    # free blocks its local cache kept, and no request)
    if holds:
        assert said.kind == "leak_dead_owner" and said.request == "2099"
        assert f"pid {pid} died while attached to the pool" in said.message
        assert "holding 2 block(s) of request(s) '2099'" in said.message
        assert "os._exit, a signal or a crash" in said.message
    else:
        assert said.request is None and "of request(s)" not in said.message
        assert (
            "holding 0 block(s) and " in said.message and "free in its local cache" in said.message
        )
    pool.reclaim_dead()


def test_a_sequence_left_preempted_at_exit_is_a_leak(probes, make_pool, monkeypatch, capsys):
    from kvscope.child import report_held

    # GIVEN a request set waiting and preempted by another's allocation, which the engine
    # then lost (never resumed nor ended), beside one it still holds
    monkeypatch.setenv("KVSCOPE_LEAKS", "1")
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)
    lost = pool.allocate("lost", list(range(8)))
    pool.set_state(lost, "waiting")
    kept = pool.allocate("kept", list(range(100, 128)))
    assert lost.state == "preempted" and not lost.block_table
    # WHEN the process's exit check reports what it still holds
    seqs, blocks = report_held(pool, "the process exited")
    # THEN both are leaks, the preempted one about no block, and the LEAK SUMMARY counts it
    assert {s.request_id for s in seqs} == {"lost", "kept"} and blocks == 7
    found = {f.request: f for f in pool.findings() if f.kind == "leak_finished"}
    assert found["lost"].block is None and found["kept"].block is not None
    assert "'lost'" in found["lost"].message and (
        "was preempted and neither resumed nor ended when the process exited"
        in found["lost"].message
    )
    err = capsys.readouterr().err
    assert "7 blocks" in err and "in 2 request(s)" in err and "(1 of them preempted" in err
    pool.free(kept)
    pool.free(lost)


def test_a_worker_that_an_exception_ended_names_its_leaks_by_the_failure():
    from kvscope.analysis import likely_causes
    from kvscope.child import exit_when

    # GIVEN the exit check of a process ending normally, and of one an exception ends (its
    # check runs in the finally the exception passes through, as a multiprocessing child's)
    assert exit_when() == "the process exited"
    with pytest.raises(IndexError):
        try:
            [][1]
        finally:
            raising = exit_when()
    assert raising == "the process exited raising IndexError"
    # WHEN its leak, which the recorder also shows left alone while others were served, is
    # named
    leak = {
        "kind": "leak_finished",
        "block": 11,
        "owner_pid": 7,
        "request": "r1",
        "message": f"request 'r1' (created at e.py:245) still held 5 block(s) when {raising}:"
        " free or abort every sequence when its request ends",
        "served_after": {"last_ns": 1, "last_op": "allocate", "requests": ["b"], "count": 1},
    }
    (cause,) = likely_causes({"block_size": 4, "slots_per_block": 5}, [leak])
    # THEN it is the failure's, not a request the scheduler dropped
    assert cause.startswith(
        "requests the program still held when it failed ('r1'; pid 7 raised IndexError)"
    )


@pytest.mark.parametrize("attached", [False, True])
def test_a_worker_that_an_inherited_handle_ended_is_a_finding(make_pool, attached):
    from kvscope.allocator import KVPool, PoolError
    from kvscope.child import report_inherited
    from tests.forking import fork_child, wait_child

    # GIVEN a forked worker that allocates through the handle its parent opened (the bug), or
    # through one it attached itself, and raises what that raised
    pool = make_pool(num_blocks=16)

    def work() -> int:
        mine = KVPool.attach(pool.name) if attached else pool
        try:
            try:
                mine.allocate("r0", [1, 2, 3])
                raise RuntimeError("served")
            finally:
                # (its exit check, in the finally that the exception passes through)
                said = report_inherited(pool)
        except (PoolError, RuntimeError):
            pass
        if attached:
            mine.free(mine.allocate("r1", [4]))
            mine.close()
        return 0 if said is not attached else 3

    pid = fork_child(work, alarm_s=60)
    assert wait_child(pid) == 0
    # THEN only the inherited handle's failure is a finding, naming the worker and the opener
    found = [f for f in pool.findings() if f.kind == "handle_inherited"]
    if attached:
        assert found == []
        return
    (f,) = found
    assert f.owner_pid == pid and f.severity == "error"
    assert f"pid {pid} exited raising PoolError" in f.message
    assert f"that pid {os.getpid()} opened, inherited through fork" in f.message


@pytest.mark.slow
def test_a_dead_worker_is_also_named_for_the_blocks_only_its_prefix_hits_still_map(make_pool):
    from kvscope.allocator import KVPool
    from kvscope.supervisor import dead_owner
    from tests.forking import fork_child, wait_child

    # GIVEN a prompt of two blocks the creator published and freed (cached), and a forked
    # worker whose request hit it, then left with os._exit without closing its handle
    pool = make_pool(num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
    first = pool.allocate("sys", list(range(9)))
    pool.mark_computed(first, 8)
    pool.free(first)

    def work() -> int:
        mine = KVPool.attach(pool.name)
        seq = mine.allocate("w0", [*range(8), 50, 51])
        assert seq.num_cached_tokens == 8
        return 0

    pid = fork_child(work, alarm_s=60)
    assert wait_child(pid) == 0
    # WHEN the supervisor says what it left THEN it counts the block it allocated, and the two
    # the creator allocated that only its request still maps, as the whole-pool check does
    said = dead_owner(pool.view, pid)
    assert "holding 1 block(s) of request(s) 'w0'" in said.message
    assert "its requests were also the last to map 2 block(s) other processes allocated" in (
        said.message
    )


def test_the_requests_of_a_hung_script_killed_are_named_by_the_kill_and_the_hang(
    probes, make_pool, tmp_path
):
    import os

    from kvscope.allocator.dumpfile import write_dump
    from kvscope.allocator.dumpread import read_dump

    # GIVEN a process (forked here) that attached, took a request and was killed before any
    # exit check ran, and a dump about it, as `kvscope run` writes one after a hang's kill
    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4, max_clients=4)
    child = os.fork()
    if child == 0:
        try:
            type(pool).attach(pool.name).allocate("stuck", (1, 2, 3, 4, 5))
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    how = f"child pid {child} was killed by SIGKILL; hung 20 s with 1 request(s) holding blocks"
    path = write_dump(
        pool, tmp_path / "p.kvd", reason=f"{how}; blocks leaked", pid=child, failed=True
    )
    # WHEN the dump is analyzed
    view, header = read_dump(path)
    report = analyze_view(view, dump_header=header)
    # THEN the dead owner's request is named as held when the program failed, with how it
    # failed and the hang before it
    assert "stuck" in [f["request"] for f in report["findings"] if f["kind"] == "leak_dead_owner"]
    (cause,) = report["likely_causes"]
    assert cause.startswith(f"requests the program still held when it failed ('stuck'; {how})")
    pool.reclaim_dead()
