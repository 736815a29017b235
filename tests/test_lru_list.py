"""The segment's LRU list: the eviction candidates one scan of the block records leaves for the
next evictions, shared by every process (csrc/eviction.c, docs/FORMAT.md "LRU list")."""

from __future__ import annotations

import os

import numpy as np

from kvscope.allocator import KVPool
from kvscope.allocator.check import check_view
from kvscope.allocator.dumpread import read_dump
from kvscope.allocator.layout import BlockState
from kvscope.allocator.records import EVICT_BATCH, LRU_KEEP
from kvscope.dumpfile import write_dump
from tests.forking import fork_child, wait_child

# Over twice LRU_KEEP cached blocks: a scan remembers LRU_KEEP candidates.
BLOCKS = 2 * LRU_KEEP + 256


def _full_cache(make_pool) -> KVPool:
    """A pool whose blocks are all cached but 8 (one-block published prompts, freed)."""
    pool = make_pool(BLOCKS, block_size=4, local_cache_size=0, max_clients=4)
    for i in range(BLOCKS - 8):
        s = pool.allocate(f"p{i}", [i, i, i, i, 0])
        pool.mark_computed(s, 4)
        pool.free(s)
    return pool


def _lru(pool: KVPool) -> dict[str, int]:
    h = pool.view.lru_header[0]
    return {name: int(h[name]) for name in ("count", "pos", "cached", "scans", "takes")}


def _allocate_fresh(pool: KVPool, salt: int, n: int) -> list:
    """n two-block sequences of prompts no cached block holds (each may evict)."""
    return [pool.allocate(f"{salt}-{i}", [-1, salt, i, 7, 7]) for i in range(n)]


def test_evictions_after_a_scan_take_the_oldest_from_the_list(make_pool):
    # GIVEN a full cache whose oldest blocks were partly hit again (they become the newest)
    pool = _full_cache(make_pool)
    for i in range(0, 64, 2):
        s = pool.allocate(f"again{i}", [i, i, i, i, 0])
        assert s.num_cached_tokens == 4
        pool.free(s)
    b = pool.view.blocks
    # WHEN allocations evict, batch after batch, through the C core
    live: list = []
    for round_ in range(8):
        cached = np.flatnonzero(b["state"] == BlockState.CACHED)
        order = cached[np.lexsort((cached, b["access_ns"][cached]))]
        live += _allocate_fresh(pool, round_, EVICT_BATCH + 1)
        gone = set(cached.tolist()) - set(np.flatnonzero(b["state"] == BlockState.CACHED).tolist())
        # THEN each time the least recently used blocks went, by (access time, block id)
        assert gone == set(order[: len(gone)].tolist()) and gone
    for s in live:
        pool.free(s)
    # AND one scan served them all: the others took from the list
    lru = _lru(pool)
    assert lru["scans"] == 1 and lru["takes"] >= 7 and lru["count"] == LRU_KEEP, lru
    assert pool.check() == []


def test_a_second_process_evicts_from_the_list_the_first_filled(make_pool):
    # GIVEN a full cache, and one eviction in this process: its scan fills the list
    pool = _full_cache(make_pool)
    first = _allocate_fresh(pool, 100, 9)
    after_a = _lru(pool)
    assert after_a["scans"] == 1 and after_a["takes"] == 0 and after_a["count"] == LRU_KEEP

    # WHEN another process attached to the pool allocates enough to evict
    def other() -> int:
        mine = KVPool.attach(pool.name)
        try:
            live = _allocate_fresh(mine, 101, 3 * (EVICT_BATCH + 1))
            for s in live:
                mine.free(s)
            return 0
        finally:
            mine.close()

    assert wait_child(fork_child(other, 60)) == 0
    # THEN its evictions took the candidates this process's scan left, with no scan of its own
    after_b = _lru(pool)
    assert after_b["scans"] == 1, after_b
    assert after_b["takes"] >= 2 and after_b["pos"] > after_a["pos"], after_b
    for s in first:
        pool.free(s)
    assert pool.check() == []


def test_a_damaged_list_only_costs_a_scan(make_pool):
    # GIVEN a full cache whose list names blocks that are not what the list says: wrong
    # access times, ids out of range, a count past the list's end
    pool = _full_cache(make_pool)
    lru = pool.view.lru
    rng = np.random.default_rng(5)
    lru["block"] = rng.integers(-5, BLOCKS + 5, len(lru))
    lru["access_ns"] = rng.integers(0, 2**62, len(lru))
    pool.view.lru_header["count"] = 2**31
    b = pool.view.blocks
    cached = np.flatnonzero(b["state"] == BlockState.CACHED)
    order = cached[np.lexsort((cached, b["access_ns"][cached]))]
    # WHEN an allocation evicts
    live = _allocate_fresh(pool, 102, 9)
    # THEN it evicted the least recently used blocks (a scan: nothing listed held)
    gone = set(cached.tolist()) - set(np.flatnonzero(b["state"] == BlockState.CACHED).tolist())
    assert gone == set(order[: len(gone)].tolist()) and gone
    assert _lru(pool)["scans"] == 1 and _lru(pool)["count"] == LRU_KEEP
    for s in live:
        pool.free(s)
    assert pool.check() == []


def test_a_dump_of_a_pool_with_a_list_reads_and_checks_clean(make_pool, tmp_path):
    # GIVEN a pool whose list was filled by an eviction
    pool = _full_cache(make_pool)
    live = _allocate_fresh(pool, 103, 9)
    assert _lru(pool)["count"] == LRU_KEEP
    # WHEN it is dumped and read back
    path = write_dump(pool.name, tmp_path / "lru.kvd")
    view, _ = read_dump(path)
    # THEN the list is in the dump as it is in the pool, and the dump checks clean
    assert np.array_equal(view.lru, pool.view.lru)
    assert int(view.lru_header[0]["count"]) == LRU_KEEP
    assert check_view(view, alive=lambda pid, start: pid == os.getpid()) == []
    for s in live:
        pool.free(s)
