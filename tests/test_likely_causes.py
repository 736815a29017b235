"""The report's likely causes (kvscope.analysis.likely_causes): a cause named when the findings
point at it together, and not from any one of them alone."""

from __future__ import annotations

import pytest

from kvscope.allocator import KVPool, PoolConfig
from kvscope.analysis import analyze_view, likely_causes

BS = 4


def _serve(pool: KVPool, slots_per_block: int) -> None:
    """Two requests written, published and freed, each slot computed as
    block * slots_per_block + offset on the flat K/V."""
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    for rid in ("a", "b"):
        seq = pool.allocate(rid, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16 if rid == "a" else 17])
        for pos, tok in enumerate(seq.tokens):
            flat[:, :, seq.block_table[pos // BS] * slots_per_block + pos % BS] = float(tok)
        pool.mark_computed(seq, len(seq.tokens))
        pool.free(seq)


@pytest.mark.parametrize("formula", ["block_size", "slots_per_block"])
def test_a_slot_computed_with_block_size_in_guard_mode_is_named(pool_name, monkeypatch, formula):
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=16, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=4),
    )
    try:
        assert pool.slots_per_block == BS + 1
        _serve(pool, BS if formula == "block_size" else pool.slots_per_block)
        pool.verify()
        report = analyze_view(pool.view)
    finally:
        pool.close()
        pool.unlink()
    kinds = {f["kind"] for f in report["findings"]}
    if formula == "block_size":
        assert "guard_violation" in kinds
        assert (
            report["likely_causes"] and "block * block_size + offset" in report["likely_causes"][0]
        )
    else:
        assert not report["findings"]
        assert "likely_causes" not in report


GUARD = {"block_size": 4, "slots_per_block": 5}


def _f(kind: str, message: str = "") -> dict[str, str]:
    return {"kind": kind, "message": message}


def test_no_cause_is_named_from_one_kind_alone_or_without_guard_slots():
    # (a guard violation alone is a write one past a full block: tests/test_user_trial.py)
    (alone,) = likely_causes(GUARD, [_f("guard_violation")])
    assert alone.startswith("guard slots overwritten, and no mapped slot left unwritten")
    assert likely_causes(GUARD, [_f("kv_never_written")]) == []
    plain = {"block_size": 4, "slots_per_block": 4}
    assert likely_causes(plain, [_f("guard_violation"), _f("kv_never_written")]) == []
    # a published block changed since it was written is not an unwritten one
    changed = _f("published_block_modified", "K/V changed since request 'a' published it")
    assert likely_causes(GUARD, [_f("guard_violation"), changed]) == [alone]
    blank = _f("published_block_modified", "published before its K/V was written: ...")
    assert likely_causes(GUARD, [_f("guard_violation"), blank])


@pytest.mark.parametrize("prefill", ["last_block", "right"])
def test_blocks_published_unwritten_and_hit_name_their_readers(probes, make_pool, prefill):
    # GIVEN a request whose prefill stores every position into the slots of its last block
    # (a slot worked out from the wrong block), publishes its prompt and finishes
    pool = make_pool(num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=4, guard=True)
    prompt = list(range(1, 11))  # two full blocks and a partial one
    a = pool.allocate("a", prompt)
    spb = pool.slots_per_block
    for pos in range(len(prompt)):
        blk = a.block_table[-1] if prefill == "last_block" else a.block_table[pos // BS]
        pool.kv[:, :, blk, pos % BS] = 1.0
    pool.mark_computed(a, len(prompt))
    shared = a.block_table[:2]
    pool.free(a)
    # WHEN two later requests hit its published blocks (and store only their own positions)
    for rid in ("b", "c"):
        seq = pool.allocate(rid, prompt[:8] + [50, 51])
        assert seq.block_table[:2] == shared and seq.num_cached_tokens == 8
        for pos in range(8, 10):
            pool.kv[:, :, seq.block_table[pos // BS], pos % BS] = 1.0
        pool.free(seq)
    report = analyze_view(pool.view)
    assert spb == BS + 1
    if prefill == "right":
        assert "likely_causes" not in report and not report["findings"]
        return
    # THEN each shared block's kv_never_written names the requests that read it, and the
    # cause says the K/V went elsewhere before the publication
    unwritten = {f["block"]: f for f in report["findings"] if f["kind"] == "kv_never_written"}
    for blk in shared:
        assert unwritten[blk]["request"] == "a" and unwritten[blk]["read_unwritten"] == ["b", "c"]
    (cause,) = report["likely_causes"]
    assert cause.startswith("blocks published with positions never written, then read")
    assert "read by 'b', 'c'" in cause and "pool.slot_mapping" in cause


@pytest.mark.parametrize("end", ["abort", "free", "none", "retried"])
def test_a_store_after_its_request_was_aborted_names_the_abort(probes, make_pool, end):
    import torch

    from kvscope.kernels import store_kv
    from kvscope.probes.stores import Writers

    # GIVEN a step that worked out a request's slots, then the request ended (an abort from
    # another thread, or a free) before the step stored its K/V through those slots
    pool = make_pool(num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=4)
    seq = pool.allocate("r1", [1, 2, 3, 4, 5, 6])
    slots = torch.tensor(pool.slot_mapping(seq, 0, 6))
    writers = Writers(pool, [(seq, 0, 6)])
    if end in ("abort", "retried"):
        pool.abort(seq)
    elif end == "free":
        pool.free(seq)
    if end == "retried":
        # (another request takes the blocks, the engine admits this one again under its id,
        # and its step still holds the aborted attempt's slots, the writer named the new
        # sequence)
        other = pool.allocate("r2", [1, 2, 3, 4, 5, 6])
        retry = pool.allocate("r1", [7, 8, 9, 10, 11, 12])
        writers = Writers(pool, [(retry, 0, 6)])
    k = torch.ones(6, 1, 4)
    store_kv(k, k, pool.kv[0, 0], pool.kv[0, 1], slots, writers=writers)
    report = analyze_view(pool.view)
    causes = report.get("likely_causes", [])
    if end == "none":
        assert not report["findings"] and not causes
        return
    # THEN the write is found; the cause is named for the abort only, and after a retry as
    # the aborted attempt's slots kept
    kinds = {f["kind"] for f in report["findings"]}
    assert kinds == ({"unmapped_write"} if end == "retried" else {"use_after_free"}), kinds
    raced = [c for c in causes if c.startswith("K/V written into blocks after their own request")]
    kept = [c for c in causes if c.startswith("K/V written into blocks a request held before")]
    assert len(raced) == (end == "abort") and len(kept) == (end == "retried"), causes
    if end == "abort":
        assert "'r1' block" in raced[0]
    if end == "retried":
        assert "'r1' block" in kept[0] and "admitted again" in kept[0]
        assert all(f.get("readmitted_after_abort") for f in report["findings"])
    if end == "retried":
        pool.free(retry)
        pool.free(other)


def test_published_blocks_changed_beside_the_slot_formula_are_not_their_publishers_writes():
    # GIVEN guard slots overwritten, slots left unwritten (the slot formula's signature), and
    # published blocks whose K/V changed while no other request mapped them
    changed = _f("published_block_modified", "K/V changed since request 'a' published it")
    changed.update(block=3, request="a", mapped_since_published=[])
    found = [_f("guard_violation"), _f("kv_never_written"), changed]
    # WHEN the causes are named
    causes = likely_causes(GUARD, found)
    # THEN the slot formula is, and the publisher is not blamed for the changes (a token landed
    # in another block's slot explains them); without the formula's signature, it is
    assert "block * block_size + offset" in causes[0]
    assert not any("their publisher stored K/V" in c for c in causes), causes
    alone = likely_causes(GUARD, [changed])
    assert any("their publisher stored K/V" in c for c in alone), alone


@pytest.mark.parametrize("writer", ["p", "w"])
def test_a_store_after_publication_is_the_publisher_s_only_when_it_named_the_publisher(writer):
    # GIVEN a published block's K/V changed by a store given its writers, which named the
    # writer: the block's publisher 'p' itself, or another request 'w'
    message = (
        f"request {writer!r} stored K/V into block 3 at engine.py:58 store: published by"
        " request 'p' (pid 7), shared by prefix hits"
    )
    f = {"kind": "published_block_modified", "request": writer, "block": 3, "message": message}
    causes = likely_causes({"block_size": 4, "slots_per_block": 5}, [f])
    # THEN only the publisher's own store is named a store after its publication
    late = [c for c in causes if c.startswith("published blocks whose K/V changed")]
    assert late if writer == "p" else not late


@pytest.mark.parametrize("prefill", ["from_zero", "from_cached"])
def test_a_prefill_that_rewrites_the_cached_prefix_names_the_request_that_hit_it(
    probes, make_pool, prefill
):
    # GIVEN a shared system prompt published by a first request, and later requests that hit
    # it, whose prefill stores from position 0 (the bug: K/V of the cached positions stored
    # again, a little different, as a model's K/V with another batch's numerics) or from
    # seq.num_cached_tokens
    pool = make_pool(num_blocks=32, block_size=BS, num_kv_heads=1, head_dim=4, guard=True)
    system = [7, 7, 8, 8, 9, 9, 10, 10]

    def kv(tok: int, pos: int, noise: float) -> float:
        return float(tok * 31 + pos) + noise

    for r in range(3):
        seq = pool.allocate(f"chat-{r}", [*system, 100 + r, 200 + r])
        start = 0 if prefill == "from_zero" else seq.num_cached_tokens
        for pos in range(start, len(seq.tokens)):
            (slot,) = pool.slot_mapping(seq, pos, pos + 1)
            b, off = divmod(int(slot), pool.slots_per_block)
            pool.kv[:, :, b, off] = kv(seq.tokens[pos], pos, 1e-3 * r)
        pool.mark_computed(seq, len(seq.tokens))
        pool.free(seq)
    report = analyze_view(pool.view)
    if prefill == "from_cached":
        assert not report["findings"] and "likely_causes" not in report
        return
    # THEN the cause names the first request that hit the prefix, in both shared blocks
    (cause,) = report["likely_causes"]
    assert cause.startswith("published prefix blocks written by requests that hit them")
    assert "('chat-1' blocks 0, 1)" in cause and "seq.num_cached_tokens" in cause
    assert "'chat-0'" not in cause and "'chat-2'" not in cause


def test_a_prefill_at_slots_counted_from_the_hit_by_several_hitters_at_once_names_them(
    probes, make_pool
):
    # GIVEN a shared system prompt published by a first request, then three requests that hit
    # it while all three are running, whose prefill stores positions [hit, n) at the slots of
    # positions [0, n - hit) (the trial's prefix_offset: slots counted from the hit): into the
    # cached blocks, the last positions of each prompt left unwritten
    pool = make_pool(num_blocks=32, block_size=BS, num_kv_heads=1, head_dim=4, guard=True)
    system = [7, 7, 8, 8, 9, 9, 10, 10]

    def store(seq, start: int, end: int, at: int) -> None:
        slots = pool.slot_mapping(seq, at, at + end - start)
        for pos, slot in zip(range(start, end), slots):
            b, off = divmod(int(slot), pool.slots_per_block)
            pool.kv[:, :, b, off] = float(seq.tokens[pos] * 31 + pos)

    first = pool.allocate("sys", [*system, 1, 2])
    store(first, 0, len(first.tokens), 0)
    pool.mark_computed(first, len(first.tokens))
    pool.free(first)
    hitters = [
        pool.allocate(f"chat-{r}", [*system, *range(100 + 8 * r, 108 + 8 * r)]) for r in range(3)
    ]
    for seq in hitters:
        hit = seq.num_cached_tokens
        store(seq, hit, len(seq.tokens), 0)
    for seq in hitters:
        pool.free(seq)
    report = analyze_view(pool.view)
    # THEN one cause: the hitters' writes into the cached blocks, naming them, not the publisher
    assert {"published_block_modified", "kv_never_written"} <= {
        f["kind"] for f in report["findings"]
    }
    (cause,) = report["likely_causes"]
    assert cause.startswith("published prefix blocks written by requests that hit them")
    assert "'chat-0'" in cause and "'sys'" not in cause


def _event(op: str, request: str, t: int) -> dict:
    return {"op": op, "request": request, "time_ns": t}


def test_stores_after_a_hit_at_slots_counted_from_the_hit_are_one_cause_not_a_resume():
    # GIVEN what an engine leaves that stores the chunk after a prefix hit at the slots of
    # positions 0, 1, ... (the trial's prefix_pos): stores given their writers into the shared
    # blocks by the requests that hit them (one of them resumed after a preemption, its resume
    # hitting the prefix again), and the positions after the hit unwritten in their own blocks
    shared = [_event("allocate", "r0", 1), _event("publish", "r0", 2)]
    hit6, hit8 = _event("prefix_hit", "r6", 3), _event("prefix_hit", "r8", 5)
    findings = [
        {
            "kind": "published_block_modified",
            "message": f"request {w!r} stored K/V into block {b} at engine.py:267 s_forward:"
            " published by request 'r0' (pid 7), shared by prefix hits",
            "block": b,
            "request": w,
            "time_ns": t,
            "events": [*shared, hit6, _event("preempt", "r8", 4), hit8],
        }
        for w, b, t in (("r6", 0, 6), ("r8", 1, 7))
    ] + [
        {
            "kind": "kv_never_written",
            "message": f"request {r!r} finished with positions 16-19 (4 slot(s)) of this block"
            " never written: a copy-on-write copy skipped, or K/V written through a stale table",
            "block": b,
            "request": r,
            "time_ns": 9,
            "events": [],
            **extra,
        }
        for r, b, extra in (("r6", 36, {}), ("r8", 28, {"preempted_blocks": [0, 1, 2, 43]}))
    ]
    # WHEN the causes are named THEN one: the hitters' writes into the cached blocks, with the
    # positions they left unwritten; no resume, block opener or stale-table cause beside it
    (cause,) = likely_causes(GUARD, findings)
    assert cause.startswith("published prefix blocks written by requests that hit them")
    assert "('r6' block 0, 'r8' block 1)" in cause and "'r6', 'r8' also left" in cause


def test_the_first_bad_event_is_never_one_after_its_finding(probes, make_pool):
    # GIVEN a receive under a write lease into a request aborted meanwhile, whose store (given
    # its writers) is found writing into the freed block, and whose lease is released after
    # that finding (a lease_end on the released generation)
    import torch

    from kvscope.kernels import store_kv
    from kvscope.probes.stores import Writers

    pool = make_pool(num_blocks=8, block_size=BS, num_kv_heads=1, head_dim=4, guard=True)
    seq = pool.allocate("rx", list(range(6)))
    writers = Writers(pool, [(seq, 0, 6)])
    slots = torch.tensor(pool.slot_mapping(seq, 0, 6), dtype=torch.int64)
    lease = pool.lease(seq, "write", holder="kv-recv")
    pool.abort(seq)
    k = torch.ones(6, 1, 4)
    store_kv(k, -k, pool.kv[0, 0], pool.kv[0, 1], slots, block_size=BS, writers=writers)
    lease.release()
    # (and its blocks handed out again: the lease's end is on a generation released since)
    again = pool.allocate("next", list(range(50, 50 + 8 * BS)))
    report = analyze_view(pool.view)
    pool.free(again)
    # THEN the write after free is found, and whatever first bad event it names came before it
    found = [f for f in report["findings"] if f["kind"] == "use_after_free"]
    assert found
    for f in found:
        bad = f.get("first_bad_event")
        assert bad is None or bad["time_ns"] <= f["time_ns"], (bad, f["time_ns"])


def test_a_publisher_storing_into_its_own_block_after_its_resume_hit_it_is_not_a_hitter():
    # GIVEN a request that published a block, was preempted, and whose resume mapped the block
    # again by a prefix hit, then stored into it (a table kept across the preemption: last
    # session's trial's stale_table), with its resume's blocks left unwritten
    events = [
        _event("allocate", "r1", 1),
        _event("publish", "r1", 2),
        _event("preempt", "r1", 3),
        _event("free", "r1", 4),
        _event("prefix_hit", "r1", 5),
    ]
    findings = [
        {
            "kind": "published_block_modified",
            "message": "request 'r1' stored K/V into block 24 at engine.py:103 store: published"
            " by request 'r1' (pid 7), shared by prefix hits",
            "block": 24,
            "request": "r1",
            "time_ns": 6,
            "events": events,
        },
        {
            "kind": "kv_never_written",
            "message": "request 'r1' finished with positions 8-11 (4 slot(s)) of this block"
            " never written: a copy-on-write copy skipped, or K/V written through a stale table",
            "block": 30,
            "request": "r1",
            "time_ns": 9,
            "events": [],
            "preempted_blocks": [24, 25],
        },
    ]
    # WHEN the causes are named THEN not the hitters' (the publisher is no request that hit
    # another's prefix), and the resume's cause is there
    causes = likely_causes(GUARD, findings)
    assert not any(c.startswith("published prefix blocks written by requests") for c in causes)
    assert any(c.startswith("requests preempted and resumed") for c in causes)


@pytest.mark.parametrize(
    "reason,named",
    [
        (
            "child pid 7 raised MemoryError: KV cache OOM: need 8 blocks, 0 free (engine.py:164 in admit)",
            True,
        ),
        (
            "child pid 7 raised RuntimeError: out of memory for the batch (engine.py:9 in step)",
            True,
        ),
        ("child pid 7 raised PoolExhausted: pool 'x': need 8 blocks (engine.py:9 in step)", False),
        ("child pid 7 raised RuntimeError: boom (engine.py:9 in step)", False),
    ],
)
def test_an_oom_of_the_programs_own_with_blocks_an_allocation_takes_is_named(reason, named):
    # GIVEN a dump of a program that failed so, the pool then holding 1 free, 47 cached and 16
    # quarantined blocks (its admission check counted stats()["num_free"] alone)
    dump = {"pid": 7, "reason": reason, "failed": True}
    by_state = {"free": 1, "allocated": 0, "cached": 47, "local": 0, "quarantined": 16}
    # WHEN the causes are named
    causes = likely_causes(GUARD, [], dump, by_state)
    # THEN an out-of-memory error of its own names the blocks an allocation would have taken
    if not named:
        assert causes == []
        return
    (cause,) = causes
    assert cause.startswith("the program failed with ")
    assert "64 blocks an allocation takes (1 free, 47 cached" in cause
    assert "16 quarantined" in cause and "stats()['num_available']" in cause
    # AND not where nothing but free blocks were left (a pool truly full)
    full = {"free": 0, "allocated": 64, "cached": 0, "local": 0, "quarantined": 0}
    assert likely_causes(GUARD, [], dump, full) == []


def test_num_available_counts_what_an_allocation_takes(make_pool):
    # GIVEN a guarded pool whose blocks are all cached (published, freed), then all quarantined
    pool = make_pool(num_blocks=8, block_size=BS, num_kv_heads=1, head_dim=4, guard=True)
    seq = pool.allocate("a", list(range(8 * BS)))
    pool.mark_computed(seq, 8 * BS)
    pool.free(seq)
    st = pool.stats()
    assert (st["num_free"], st["num_cached"], st["num_available"]) == (0, 8, 8)
    again = pool.allocate("b", list(range(100, 100 + 8 * BS)))  # (evicts the cached ones)
    pool.free(again)
    st = pool.stats()
    # THEN num_available counts them either way, and an allocation of all of them succeeds
    assert (st["num_free"], st["num_quarantined"], st["num_available"]) == (0, 8, 8)
    pool.free(pool.allocate("c", list(range(200, 200 + 8 * BS))))


def _store_at(pool, slot: int, value: float) -> None:
    """K/V `value` stored at flat slot `slot` (every layer, K and V)."""
    b, off = divmod(int(slot), pool.slots_per_block)
    pool.kv[:, :, b, off] = value


def _prompt_stored(pool, request: str, tokens: list[int]):
    """A request allocated and its prompt's K/V stored where pool.slot_mapping says."""
    seq = pool.allocate(request, tokens)
    for pos, slot in enumerate(pool.slot_mapping(seq, 0, len(tokens))):
        _store_at(pool, slot, 1.0 + pos)
    return seq


def test_a_decode_storing_one_slot_late_in_guard_mode_is_not_the_slot_formula(probes, make_pool):
    # GIVEN requests whose prefill stores right, and whose decode stores position p's K/V at
    # the slot after p's (slot + 1: a block's last position goes into its guard slot, the next
    # block's first position is never written): a second trial's slot_plus_one
    pool = make_pool(num_blocks=32, block_size=BS, num_kv_heads=1, head_dim=4, guard=True)
    for r in range(2):
        seq = _prompt_stored(pool, f"d{r}", list(range(10 * r, 10 * r + 3)))
        for pos in range(3, 3 + 3 * BS):
            pool.append(seq, [100 + pos])
            (slot,) = pool.slot_mapping(seq, pos, pos + 1)
            _store_at(pool, int(slot) + 1, 1.0 + pos)
        pool.free(seq)
    report = analyze_view(pool.view)
    assert {"guard_violation", "kv_never_written"} <= {f["kind"] for f in report["findings"]}
    # THEN the one cause is the store one position late, into the guard slot, and not the
    # slot formula nor guard slots overwritten with no mapped slot unwritten
    (cause,) = report["likely_causes"]
    assert cause.startswith("positions never written, each the first slot of its block")
    assert "one position late" in cause and "guard slot" in cause


def test_positions_left_between_written_ones_are_stores_at_other_slots_not_a_short_range(
    probes, make_pool
):
    # GIVEN requests whose decode stores every fourth position through the block table it kept
    # from its first step (a second trial's stale_table: that slot, clamped to the old table's
    # last block, is another position's), leaving single positions between written ones
    bs = 16
    pool = make_pool(num_blocks=32, block_size=bs, num_kv_heads=1, head_dim=4, guard=True)
    for r in range(2):
        seq = _prompt_stored(pool, f"s{r}", list(range(10 * r, 10 * r + 2)))
        kept = list(seq.block_table)
        for step, pos in enumerate(range(2, 2 + 2 * bs)):
            pool.append(seq, [100 + pos])
            if step % 4 == 3:
                slot = kept[-1] * pool.slots_per_block + pos % bs  # the stale table
            else:
                (slot,) = pool.slot_mapping(seq, pos, pos + 1)
            _store_at(pool, int(slot), 1.0 + pos)
        pool.free(seq)
    report = analyze_view(pool.view)
    # THEN the positions between written ones are named as stores at other slots, and no write
    # range that stops short is blamed
    causes = report["likely_causes"]
    (between,) = [c for c in causes if c.startswith("positions never written between written")]
    assert "block table kept from an earlier step" in between
    assert not [c for c in causes if "stops short" in c], causes
