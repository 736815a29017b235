"""The free ring of a pool: FIFO of free block ids under the `free` lock, with guard mode's
quarantine. `BlockStore.ring_pop` and `BlockStore.ring_push` (blocks.py) call these; the store
provides the views and journaling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.crash import crash_point
from kvscope.allocator.layout import RING_HEADER_DTYPE, BlockState
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.blocks import BlockStore


def _save_ring_header(store: BlockStore, t: Txn) -> None:
    t.journal.save(store.ring_off, RING_HEADER_DTYPE.itemsize)


def pop(store: BlockStore, t: Txn, k: int) -> np.ndarray:
    """Take k ids from the ring head (skipping blocks still in quarantine while others exist)."""
    t.need(store.free_lock)
    h = store.ring_header
    k = min(k, int(h["count"][0]))
    head = int(h["head"][0])
    pos = (head + np.arange(k)) % store.num_blocks
    ids = store.ring[pos].astype(np.int64)
    _save_ring_header(store, t)
    h["head"] = head + k
    h["count"] = int(h["count"][0]) - k
    if store.quarantine:
        ids = _release_quarantine(store, t, ids)
    h["allocs"] = int(h["allocs"][0]) + len(ids)
    crash_point("blocks.after_ring_pop")
    return ids


def _release_quarantine(store: BlockStore, t: Txn, ids: np.ndarray) -> np.ndarray:
    """Send blocks freed fewer than `quarantine` allocations ago back to the tail, taking
    older free blocks instead; when only young ones are left, they are used anyway."""
    h = store.ring_header
    allocs = int(h["allocs"][0])
    young = (store.state[ids] == BlockState.QUARANTINED) & (
        allocs - store.blocks["freed_at"][ids].astype(np.int64) < store.quarantine
    )
    if not young.any():
        return ids
    keep, back = ids[~young], ids[young]
    want = len(ids)
    # Older blocks behind the head (at most one lap of the ring).
    extra: list[int] = []
    for _ in range(int(h["count"][0])):
        if len(keep) + len(extra) >= want:
            break
        (b,) = pop_raw(store, t, 1)
        if (
            store.state[b] == BlockState.QUARANTINED
            and allocs - int(store.blocks["freed_at"][b]) < store.quarantine
        ):
            back = np.append(back, b)
        else:
            extra.append(int(b))
    got = np.concatenate([keep, np.asarray(extra, np.int64)])
    short = want - len(got)
    if short > 0:
        got, back = np.concatenate([got, back[:short]]), back[short:]
    _push_raw(store, t, back)
    return got


def pop_raw(store: BlockStore, t: Txn, k: int) -> np.ndarray:
    """Pop k ids from the head with no quarantine rule (the caller holds the free lock)."""
    h = store.ring_header
    head = int(h["head"][0])
    ids = store.ring[(head + np.arange(k)) % store.num_blocks].astype(np.int64)
    h["head"] = head + k
    h["count"] = int(h["count"][0]) - k
    return ids


def push(store: BlockStore, t: Txn, ids: np.ndarray, state: BlockState = BlockState.FREE) -> None:
    """Return blocks to the ring tail as FREE (QUARANTINED in guard mode)."""
    t.need(store.free_lock)
    k = len(ids)
    if k == 0:
        return
    store.save(t, ids)
    store.state[ids] = state
    store.refcount[ids] = 0
    store.indexed[ids] = 0
    # owner_pid and request stay: the last owner of a free block, for post-mortems.
    store.blocks["owner_client"][ids] = -1
    store.seal(ids)
    crash_point("blocks.after_release_records")
    if state == BlockState.QUARANTINED:
        store.blocks["freed_at"][ids] = int(store.ring_header["allocs"][0])
    _push_raw(store, t, ids)
    crash_point("blocks.after_ring_push")


def _push_raw(store: BlockStore, t: Txn, ids: np.ndarray) -> None:
    """Append ids at the ring tail (journaled; records unchanged)."""
    k = len(ids)
    if k == 0:
        return
    h = store.ring_header
    tail = int(h["tail"][0])
    _save_ring_header(store, t)
    pos = (tail + np.arange(k)) % store.num_blocks
    first = tail % store.num_blocks
    n1 = min(k, store.num_blocks - first)
    t.journal.save(store.ring_off + RING_HEADER_DTYPE.itemsize + 4 * first, 4 * n1)
    if n1 < k:
        t.journal.save(store.ring_off + RING_HEADER_DTYPE.itemsize, 4 * (k - n1))
    store.ring[pos] = ids
    h["tail"] = tail + k
    h["count"] = int(h["count"][0]) + k
