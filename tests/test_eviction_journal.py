"""Eviction never outgrows the undo journal: an allocation that must evict more cached blocks
than one transaction's journal holds (512 entries) evicts them ahead, in transactions of their
own, and succeeds; so does `pool.evict(n)` for any n."""

from __future__ import annotations

import os
import signal
import traceback

import numpy as np
import pytest

from kvscope.allocator import BlockState, KVPool
from kvscope.allocator.layout import JOURNAL_ENTRIES

BS = 4


def _fill_one_shard(pool: KVPool, bs: int) -> int:
    """Publish prompts that share their first block until their index shard is full (every
    block of a prompt lives in its first key's shard), free them; return the shard's width."""
    keys = pool.view.index["hash"]
    width = len(keys) // pool.view.layout.num_shards
    for i in range(4 * width):
        toks = [7] * bs + [100_000 + 1000 * i + j for j in range(7 * bs)] + [1]
        s = pool.allocate(f"p{i}", toks)
        pool.mark_computed(s, len(toks))
        pool.free(s)
        if max((keys[s0 : s0 + width] != 0).sum() for s0 in range(0, len(keys), width)) == width:
            return width
    raise AssertionError("the shard never filled")


def hold_free_blocks(pool: KVPool) -> list:
    """Live sequences (first blocks of their own) holding every free block (the local
    cache's too)."""
    held = []
    while True:
        st = pool.stats()
        free = st["num_free"] + st["num_local"]
        if free == 0:
            return held
        n = min(free, 32)
        held.append(pool.allocate(f"h{len(held)}", [50_000 + len(held)] * (n * pool.block_size)))


def _full_shard_pool(make_pool, bs: int = BS) -> KVPool:
    # 256 blocks: 1024 index slots, 8 shards of 128; 128 cached blocks fill one shard, whose
    # entries each sit far from home: every removal shifts several back.
    pool = make_pool(256, block_size=bs, local_cache_size=4)
    width = _fill_one_shard(pool, bs)
    hold_free_blocks(pool)
    assert pool.stats()["num_cached"] == width == 128
    return pool


@pytest.mark.parametrize("bs", [4, 48])
def test_an_allocation_evicting_a_full_shard_succeeds(make_pool, bs):
    # GIVEN a pool with no free block and 128 cached blocks filling one index shard
    pool = _full_shard_pool(make_pool, bs)
    # (each of those evictions journals its record and its index removal: one transaction
    # evicting all 128 and stamping 128 needs more than the journal's 512 entries)
    assert JOURNAL_ENTRIES == 512
    # WHEN one allocation needs all 128 of them (evicted ahead, in transactions of their own,
    # when the journal runs out)
    seq = pool.allocate("big", [5] * (128 * bs))
    # THEN it gets them, the index holds none of them, and the pool is consistent
    assert len(seq.block_table) == 128
    st = pool.stats()
    assert st["num_cached"] == 0 and st["num_evictions"] == 128
    assert (pool.view.index["hash"] != 0).sum() == 0
    assert pool.check() == []
    pool.free(seq)
    assert pool.check() == []


def test_the_same_allocation_fits_with_room_to_spare_when_the_shard_is_sparse(make_pool):
    # GIVEN 128 cached blocks spread over every shard (distinct first blocks)
    pool = make_pool(256, block_size=BS, local_cache_size=4)
    for i in range(16):
        s = pool.allocate(f"p{i}", [1000 + 100 * i + j for j in range(8 * BS)] + [1])
        pool.mark_computed(s, s.num_tokens)
        pool.free(s)
    hold_free_blocks(pool)
    assert pool.stats()["num_cached"] == 128
    # WHEN one allocation evicts them all, THEN it succeeds and the pool is consistent
    seq = pool.allocate("big", [5] * (128 * BS))
    assert len(seq.block_table) == 128 and pool.stats()["num_cached"] == 0
    assert pool.check() == []


def test_evict_takes_more_blocks_than_one_journal_holds(make_pool):
    # GIVEN 700 cached blocks (more than the journal's 512 entries)
    pool = make_pool(1024, block_size=BS)
    for i in range(35):
        s = pool.allocate(f"p{i}", [1000 * i + j for j in range(20 * BS)])
        pool.mark_computed(s, s.num_tokens)
        pool.free(s)
    assert pool.stats()["num_cached"] == 700
    # WHEN pool.evict asks for all of them, THEN all are evicted (several transactions)
    assert pool.evict(1000) == 700
    st = pool.stats()
    assert st["num_cached"] == 0 and st["num_evictions"] == 700
    assert pool.check() == []


# Block size 4: the journal holds the evictions with the stamp (each removal journals at most
# two ranges of index slots); block size 48: the 128 evicted records and their stamp outgrow
# it, so they are evicted ahead.
@pytest.mark.parametrize(("bs", "take"), [(4, 100), (4, 128), (48, 128)])
def test_the_core_evicts_ahead_itself_in_least_recently_used_order(make_pool, bs, take):
    # GIVEN the full shard of cached blocks, least recently used first, on the C core
    pool = _full_shard_pool(make_pool, bs)
    b = pool.view.blocks
    cached = np.flatnonzero(b["state"] == BlockState.CACHED)
    order = cached[np.lexsort((cached, b["access_ns"][cached]))].tolist()
    before = pool._core.stats()
    # WHEN an allocation takes `take` of them (block size 48: their eviction and stamp outgrow
    # the journal)
    seq = pool.allocate("big", [5] * (take * bs))
    # THEN the core did it all: the oldest went, the newest are still cached, the sequence got
    # the oldest
    after = pool._core.stats()
    gone = pool.stats()["num_evictions"]
    assert gone >= take and after["evictions"] - before["evictions"] == gone
    left = np.flatnonzero(b["state"] == BlockState.CACHED).tolist()
    assert sorted(left) == sorted(order[gone:])
    assert set(seq.block_table) <= set(order[:gone])
    assert pool.check() == []


def test_evict_of_more_than_a_chunk_runs_in_the_core_in_lru_order(make_pool):
    # GIVEN 300 cached blocks (more than CHUNK, 128), with their least recently used order
    pool = make_pool(512, block_size=BS)
    for i in range(15):
        s = pool.allocate(f"p{i}", [1000 * i + j for j in range(20 * BS)])
        pool.mark_computed(s, s.num_tokens)
        pool.free(s)
    b = pool.view.blocks
    cached = np.flatnonzero(b["state"] == BlockState.CACHED)
    order = cached[np.lexsort((cached, b["access_ns"][cached]))].tolist()
    assert len(order) == 300
    ops = pool._core.stats()["native_ops"]
    # WHEN 250 of them are evicted
    assert pool.evict(250) == 250
    # THEN one call into the core evicted the 250 oldest, the newest 50 stay cached, the counters say so and the pool is consistent
    assert pool._core.stats()["native_ops"] == ops + 1
    left = np.flatnonzero(b["state"] == BlockState.CACHED).tolist()
    assert sorted(left) == sorted(order[250:])
    st = pool.stats()
    assert st["num_evictions"] == 250 and st["num_cached"] == 50
    assert pool.check() == []
    # AND asking for more than is cached evicts what is left
    assert pool.evict(1000) == 50 and pool.evict(1) == 0


def _crash_child(name: str, point: str, bs: int) -> None:
    code = 0
    try:
        from kvscope.allocator import crash

        pool = KVPool.attach(name)
        crash.configure(point)
        pool.allocate("big", [5] * (128 * bs))
        crash.configure(None)
        code = 3
    except BaseException:
        traceback.print_exc()
        code = 4
    os._exit(code)


@pytest.mark.parametrize("point", ["blocks.after_evict:1", "blocks.after_ring_push:1"])
def test_a_kill_while_evicting_ahead_loses_no_block(make_pool, point):
    # GIVEN the full shard of cached blocks, whose eviction for one allocation outgrows the
    # journal (block size 48: the allocation evicts them ahead)
    bs = 48
    pool = _full_shard_pool(make_pool, bs)
    # WHEN another process dies inside the transaction that evicts them ahead
    pid = os.fork()
    if pid == 0:
        _crash_child(pool.name, point, bs)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
    # THEN reclaiming it leaves a consistent pool that lost no block (the transaction rolled
    # back: every block still cached), and the allocation then succeeds here
    pool.reclaim_dead()
    assert pool.check() == []
    st = pool.stats()
    assert st["num_cached"] == 128 and st["num_free"] + st["num_local"] == 0
    seq = pool.allocate("big", [5] * (128 * bs))
    assert len(seq.block_table) == 128 and pool.check() == []


def _save_child(name: str, kill_at: int, bs: int) -> None:
    try:
        pool = KVPool.attach(name)
        pool._core.set_crash_at(kill_at)
        pool.allocate("big", [5] * (128 * bs))
        code = 3
    except BaseException:
        traceback.print_exc()
        code = 4
    os._exit(code)


@pytest.mark.slow
def test_a_kill_at_any_journal_save_of_an_allocation_evicting_ahead_loses_no_block(make_pool):
    # GIVEN the allocation that evicts a full shard ahead (block size 48: 128 blocks of a full
    # shard make several hundred journal saves)
    bs = 48
    kills = [1, 2, 3, 50, 150, 300, 450, 600, 750, 900, 1200, 1600]
    # WHEN another process is killed at one of them (spread over the whole allocation)
    killed = 0
    for kill_at in kills:
        pool = _full_shard_pool(make_pool, bs)
        pid = os.fork()
        if pid == 0:
            _save_child(pool.name, kill_at, bs)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            # (past the core's last save: it finished)
            assert os.WEXITSTATUS(status) == 3, kill_at
            continue
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, kill_at
        killed += 1
        # THEN reclaiming it leaves a consistent pool that lost no block: each block cached,
        # evicted to the free ring (a committed evict-ahead), or nothing changed
        pool.reclaim_dead()
        assert pool.check() == [], kill_at
        st = pool.stats()
        assert st["num_allocated"] == sum(len(s.block_table) for s in pool.live().values())
        assert st["num_free"] + st["num_local"] + st["num_cached"] + st["num_allocated"] == 256
        assert st["num_free"] + st["num_local"] + st["num_cached"] == 128, kill_at
    assert killed >= 6


def test_evict_runs_in_the_core(make_pool):
    # GIVEN cached blocks
    pool = make_pool(64, block_size=BS)
    s = pool.allocate("p", list(range(8 * BS)))
    pool.mark_computed(s, s.num_tokens)
    pool.free(s)
    stats = pool._core.stats()
    # WHEN they are evicted
    assert pool.evict(100) == 8
    # THEN the core evicted them, and the pool is consistent
    after = pool._core.stats()
    assert after["native_ops"] == stats["native_ops"] + 1
    assert after["evictions"] == stats["evictions"] + 8
    assert pool.stats()["num_cached"] == 0 and pool.check() == []
