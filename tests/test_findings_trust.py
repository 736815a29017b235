"""Findings you can trust: faults that act before they announce and wait for an opportunity they
can use, owners and requests from the right record, refused double frees recorded, scribbled
block records caught at the first touch."""

from __future__ import annotations

import inspect

import pytest

from kvscope.allocator import KVPool, PoolError, faults
from kvscope.allocator.sites import site_text
from kvscope.child import report_held


def found(pool: KVPool, kind: str) -> list:
    return [f for f in pool.findings() if f.kind == kind]


def test_a_leaked_block_is_named_by_its_own_request(make_pool, probes):
    # GIVEN the leak fault armed for the first request that ends
    pool = make_pool(16)
    faults.configure("leak:1")
    seq = pool.allocate("r5", list(range(10)))
    last = seq.block_table[-1]
    # WHEN it ends
    pool.free(seq)
    # THEN leak_finished names the block it kept, its owner and its request
    (f,) = found(pool, "leak_finished")
    assert (f.block, f.owner_pid, f.request) == (last, pool.pid, "r5")


def test_double_free_waits_for_a_release_that_frees_a_block(make_pool, probes, capfd):
    # GIVEN double-free armed at the first opportunity, and a request whose blocks all stay
    # cached when it ends (published), so its release frees nothing
    pool = make_pool(16)
    faults.configure("double-free:1")
    cached = pool.allocate("cached", list(range(8)))
    pool.mark_computed(cached, 8)
    pool.free(cached)
    # THEN nothing was injected yet
    assert "injecting" not in capfd.readouterr().err
    assert faults.unfired() == ["double-free"]
    # WHEN a request with blocks of its own ends
    priv = pool.allocate("priv", [50, 51, 52, 53, 54])
    last = priv.block_table[-1]
    pool.free(priv)
    # THEN the fault freed its last block twice, said so once, and the probe reported it
    assert capfd.readouterr().err.count("injecting fault 'double-free'") == 1
    assert faults.unfired() == []
    (f,) = found(pool, "double_free")
    assert (f.block, f.owner_pid, f.request) == (last, pool.pid, "priv")


def test_a_fault_without_an_opportunity_stays_unfired(make_pool, probes, capfd):
    # GIVEN the leak fault armed at the 3rd opportunity, WHEN only two requests end
    pool = make_pool(16)
    faults.configure("leak")
    for i in range(2):
        pool.free(pool.allocate(f"r{i}", [i + 1] * 5))
    # THEN it is still armed, and nothing said it was injected
    assert faults.unfired() == ["leak"]
    assert "injecting" not in capfd.readouterr().err
    assert not found(pool, "leak_finished")


def test_a_refused_double_free_is_recorded(make_pool, probes):
    # GIVEN a request already freed
    pool = make_pool(16)
    seq = pool.allocate("twice", [1, 2, 3, 4, 5])
    pool.free(seq)
    # WHEN it is freed again, THEN the pool refuses it and records a double_free naming the line
    with pytest.raises(PoolError, match="already finished"):
        pool.free(seq)  # the second free
    (f,) = found(pool, "double_free")
    assert (f.owner_pid, f.request) == (pool.pid, "twice")
    assert "test_findings_trust.py" in f.message and f.severity == "error"


def test_a_stale_table_names_the_request_still_mapping_the_block(make_pool, probes):
    # GIVEN a parent and its fork; the parent ends, the fork is freed by the use-after-free
    # fault, which leaves its block table live (the blocks' records still name the parent)
    pool = make_pool(16)
    parent = pool.allocate("parent", [1, 2, 3, 4, 5, 6])
    child = pool.fork(parent, "child")
    blocks = list(child.block_table)
    pool.free(parent)
    faults.configure("use-after-free:1")
    pool.free(child)
    # WHEN the pool is checked, THEN use_after_free names the fork, the request still mapping it
    uaf = [f for f in pool.check() if f.kind == "use_after_free"]
    assert {f.block for f in uaf} == set(blocks)
    assert {(f.request, f.owner_pid) for f in uaf} == {("child", pool.pid)}
    # AND when a block is handed out again, the probe names the mapping request at once
    pool.allocate("next", [9] * 12)
    live = [f for f in found(pool, "use_after_free") if f.block in blocks]
    assert live and all(f.request == "child" for f in live)
    assert "is being handed to request 'next'" in live[0].message


def test_a_scribbled_record_is_reported_before_the_allocator_reseals_it(make_pool, probes):
    # GIVEN a published block whose record something outside the allocator overwrote
    pool = make_pool(16)
    first = pool.allocate("first", list(range(9)))
    pool.mark_computed(first, 8)
    blk = first.block_table[0]
    pool.view.blocks["refcount"][blk] = 0x5A5A5A5A
    # WHEN a prefix hit takes a reference on it (the allocator re-seals the record)
    pool.allocate("second", list(range(9)))
    # THEN block_header_corrupt was reported first, with the block's owner and request
    (f,) = found(pool, "block_header_corrupt")
    assert (f.block, f.owner_pid, f.request) == (blk, pool.pid, "first")


def test_a_request_left_held_is_reported_at_its_own_allocate_line(make_pool, probes):
    # GIVEN a request sharing another request's published prefix, never freed
    pool = make_pool(16)
    a = pool.allocate("a", list(range(9)))
    pool.mark_computed(a, 8)
    pool.free(a)
    b = pool.allocate("b", list(range(8)) + [70, 71, 72])
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    assert b.num_cached_tokens == 8
    # WHEN its process reports what it still holds
    report_held(pool, "the process exited")
    # THEN the finding is about b's own block, allocated at b's line, not the shared prefix
    (f,) = found(pool, "leak_finished")
    assert f.request == "b" and f.block == b.block_table[-1]
    site = site_text(pool.view, int(pool.view.blocks["site"][f.block]))
    assert site is not None and f"test_findings_trust.py:{line} " in site
    pool.free(b)
