"""Eviction inside a Python-path take (reserve.py, through `BlockStore.evict`): unindexing the
least recently used CACHED blocks (every index shard lock), chosen by a scan of the block
records, in the operation's own transaction (which the C core cannot join: this stays while
KVSCOPE_NATIVE=0 runs allocate and append in Python). Every other eviction is the C core's
(csrc/eviction.c): `KVPool.evict`, and the evicting ahead of an operation whose eviction
outgrew its undo journal (`evict_ahead`). The core chooses the same blocks, from the
segment's LRU list when it holds them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.crash import crash_point
from kvscope.allocator.journal import JournalFull
from kvscope.allocator.layout import BlockState
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.blocks import BlockStore
    from kvscope.allocator.pool import KVPool


def evict_ahead(pool: KVPool, e: JournalFull) -> None:
    """A Python-path operation ran out of undo journal while evicting `e.evicting` blocks (and
    was rolled back): the C core evicts them now, in transactions of its own (`KVPool.evict`),
    so that running it again takes them from the free ring. Raises `e` when none could be
    evicted."""
    if e.evicting <= 0 or pool.evict(e.evicting) == 0:
        raise e


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


def evict(
    store: BlockStore,
    t: Txn,
    k: int,
    extra: int = 0,
    keep: tuple[int, int] = (0, 0),
    to_ring: int | None = None,
    partial: bool = False,
) -> np.ndarray:
    """Unindex up to k CACHED blocks (plus up to `extra`, at most a quarter of the rest),
    least recently used first; return them (not yet reset).

    Journal-bounded: each block is evicted only if the journal still has room for it, for
    `keep` (entries, bytes) that the operation writes afterwards, and for the return to the
    free ring of it and the blocks before it from position `to_ring` on (None: no block goes
    to the ring). The extra blocks stop where the room ends; so do the first k when `partial`,
    and otherwise a block of the first k that does not fit raises `JournalFull`, naming the k
    blocks to evict ahead (runner.py).
    """
    t.need(*store.shard_locks)
    if k <= 0:
        return np.zeros(0, np.int64)
    cand = _lru_scan(store, k, extra)
    if len(cand) == 0:
        return np.zeros(0, np.int64)
    j = t.journal
    need = min(k, len(cand))
    if not partial:
        # (a partial eviction sizes itself: an overflow after it is not evicted ahead)
        j.evicting += need
    index, rec = store.index, store.record_size
    keep_entries, keep_bytes = keep
    ring_from = len(cand) if to_ring is None else to_ring
    # The records of every candidate in one save when they fit with their return to the ring
    # (the common case; a candidate left out leaves its saved record unchanged).
    pushes = max(0, len(cand) - ring_from)
    batch = j.fits(len(cand) + pushes + keep_entries, (len(cand) + pushes) * rec + keep_bytes)
    if batch:
        store.save(t, cand)
    own = 0 if batch else 1
    done: list[int] = []
    for b, key in zip(cand.tolist(), store.prefix_hash[cand].tolist()):
        r = index.plan_remove(key, b)
        assert r is not None, f"cached block {b} missing from the prefix index"
        # Its record (unless saved above), the records of the blocks so far that go to the
        # ring, what the operation keeps; then its index removal: the range of slots it
        # writes (one or two entries), or when that does not fit, each slot it writes.
        pushed = max(0, len(done) + 1 - ring_from)
        entries = own + pushed + keep_entries
        nbytes = (own + pushed) * rec + keep_bytes
        by_slot = not j.fits(entries + r.entries, nbytes + r.nbytes)
        if by_slot and not j.fits(entries + len(r.slots), nbytes + r.slot_bytes):
            if len(done) >= need or partial:
                break
            raise JournalFull(
                f"operation too large for the undo journal (evicting {need} blocks)", j.evicting
            )
        if not batch:
            store.save(t, np.array([b]))
        index.apply_remove(r, j, by_slot)
        done.append(b)
    if not done:
        return np.zeros(0, np.int64)
    ids = np.asarray(done, np.int64)
    if store.evict_hook is not None:
        store.evict_hook(t, ids)
    store.indexed[ids] = 0
    store.refcount[ids] = 0
    # In flight to the caller (stamped or pushed to the ring before the commit).
    store.state[ids] = BlockState.LOCAL
    store.blocks["owner_client"][ids] = store.client
    crash_point("blocks.after_evict")
    return ids


def _lru_scan(store: BlockStore, k: int, extra: int) -> np.ndarray:
    """The k (+extra, at most a quarter of the rest) least recently used CACHED blocks, oldest
    first."""
    cand = np.flatnonzero(store.state == BlockState.CACHED)
    if len(cand) == 0:
        return cand
    k += min(extra, max(0, len(cand) - k) // 4)
    return oldest(cand, store.access_ns[cand], k)
