"""Eviction: unindexing the least recently used CACHED blocks (every index shard lock), with
candidates remembered from one pool scan (in the store's `_lru_*` fields, which the C core reads
and writes too). `KVPool.evict` (pool.py) and `BlockStore.evict` (blocks.py) call these."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.crash import crash_point
from kvscope.allocator.layout import BlockState, block_dtype
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.blocks import BlockStore
    from kvscope.allocator.pool import KVPool

_F = block_dtype(16).fields
_STATE, _ACCESS_NS = _F["state"][1], _F["access_ns"][1]
_U8 = struct.Struct("<Q")

# Eviction candidates remembered from one pool scan (only when the cache holds over twice as many).
LRU_KEEP = 4096


def evict_to_ring(pool: KVPool, num_blocks: int) -> int:
    """Evict up to num_blocks CACHED blocks (LRU first) to the free ring; return how many."""

    def op(t: Txn) -> int:
        ids = pool.store.evict(t, num_blocks)
        if len(ids):
            pool.store.ring_push(t, ids)
            pool._count(t, "num_evictions", len(ids))
        return len(ids)

    return pool._run({pool.FREE, *pool.SHARDS}, op)


def oldest(ids: np.ndarray, ns: np.ndarray, keep: int) -> np.ndarray:
    """The `keep` ids with the smallest (access time, id), in that order (ids ascending).

    Ties are broken by id, so the choice is one (the C core's scan makes the same).
    """
    if len(ids) > keep:
        threshold = np.partition(ns, keep - 1)[keep - 1]
        pick = ns < threshold
        pick[np.flatnonzero(ns == threshold)[: keep - int(pick.sum())]] = True
        ids, ns = ids[pick], ns[pick]
    return ids[np.lexsort((ids, ns))]


def evict(store: BlockStore, t: Txn, k: int, extra: int = 0) -> np.ndarray:
    """Unindex up to k CACHED blocks (plus up to `extra`, at most a quarter of the rest),
    least recently used first; return them (not yet reset)."""
    t.need(*store.shard_locks)
    if k <= 0:
        return np.zeros(0, np.int64)
    cand = _lru_take(store, t, k, extra)
    if cand is None:
        cand = _lru_scan(store, t, k, extra)
    if len(cand) == 0:
        return np.zeros(0, np.int64)
    store.save(t, cand)
    if store.evict_hook is not None:
        store.evict_hook(t, cand)
    for b in cand.tolist():
        removed = store.index.remove(int(store.prefix_hash[b]), b, t.journal)
        assert removed, f"cached block {b} missing from the prefix index"
    store.indexed[cand] = 0
    store.refcount[cand] = 0
    # In flight to the caller (stamped or pushed to the ring before the commit).
    store.state[cand] = BlockState.LOCAL
    store.blocks["owner_client"][cand] = store.client
    crash_point("blocks.after_evict")
    return cand.astype(np.int64)


def _lru_scan(store: BlockStore, t: Txn, k: int, extra: int) -> np.ndarray:
    """The k (+extra) least recently used CACHED blocks, oldest first, from a pool scan.

    A large cache also keeps the next LRU_KEEP oldest as later candidates (from commit on):
    blocks cached after the scan are newer than all of them, so while they last they are
    still the oldest, and eviction needs no scan.
    """
    cand = np.flatnonzero(store.state == BlockState.CACHED)
    if len(cand) == 0:
        return cand
    num_cached = len(cand)
    k += min(extra, max(0, num_cached - k) // 4)
    keep = k + LRU_KEEP if num_cached > 2 * LRU_KEEP + k else k
    cand = oldest(cand, store.access_ns[cand], keep)
    if keep > k:
        later = cand[k:]
        lru = (later.tolist(), store.access_ns[later].tolist(), num_cached - k)
        t.after_commit.append(lambda: _lru_reset(store, *lru))
    return cand[:k]


def _lru_reset(store: BlockStore, ids: list[int], stamps: list[int], num_cached: int) -> None:
    store._lru_ids, store._lru_ns, store._lru_pos = ids, stamps, 0
    store._lru_cached = num_cached


def _lru_take(store: BlockStore, t: Txn, k: int, extra: int) -> np.ndarray | None:
    """The next k (+extra) remembered candidates still CACHED and untouched since the scan;
    None when fewer than k are left (the caller scans)."""
    ids, stamps, pos = store._lru_ids, store._lru_ns, store._lru_pos
    mv, base, size = store.mv, store.base, store.record_size
    cached = int(BlockState.CACHED)
    want = k + min(extra, max(0, store._lru_cached - k) // 4)
    got: list[int] = []
    while pos < len(ids) and len(got) < want:
        b = ids[pos]
        rec = base + b * size
        if mv[rec + _STATE] == cached and _U8.unpack_from(mv, rec + _ACCESS_NS)[0] == stamps[pos]:
            got.append(b)
        pos += 1
    if len(got) < k:
        store._lru_ids, store._lru_ns, store._lru_pos = [], [], 0
        return None

    def advance(pos: int = pos, n: int = len(got)) -> None:
        if store._lru_ids is ids:
            store._lru_pos = max(store._lru_pos, pos)
            store._lru_cached = max(0, store._lru_cached - n)

    t.after_commit.append(advance)
    return np.asarray(got, np.int64)
