"""The free ring of a pool: FIFO of free block ids under the `free` lock, with guard mode's
quarantine. Mixed into BlockStore (blocks.py), which provides the views and journaling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.crash import crash_point
from kvscope.allocator.layout import RING_HEADER_DTYPE, BlockState
from kvscope.allocator.txn import Txn


class RingOps:
    """Popping and pushing free blocks (the `self` is always a BlockStore)."""

    # Set by BlockStore.__init__ (blocks.py); declared here for type checkers only (no values:
    # nothing at class level).
    blocks: np.ndarray
    state: np.ndarray
    refcount: np.ndarray
    indexed: np.ndarray
    ring: np.ndarray
    ring_header: np.ndarray
    ring_off: int
    num_blocks: int
    quarantine: int
    free_lock: int

    if TYPE_CHECKING:
        # BlockStore's journaling helpers (blocks.py).
        def save(self, t: Txn, ids: np.ndarray) -> None: ...

        def seal(self, ids: np.ndarray) -> None: ...

    @property
    def ring_count(self) -> int:
        """Blocks in the free ring (a hint unless the free lock is held)."""
        return int(self.ring_header["count"][0])

    def _save_ring_header(self, t: Txn) -> None:
        t.journal.save(self.ring_off, RING_HEADER_DTYPE.itemsize)

    def ring_pop(self, t: Txn, k: int) -> np.ndarray:
        """Take k ids from the ring head (skipping blocks still in quarantine while others exist)."""
        t.need(self.free_lock)
        h = self.ring_header
        k = min(k, int(h["count"][0]))
        head = int(h["head"][0])
        pos = (head + np.arange(k)) % self.num_blocks
        ids = self.ring[pos].astype(np.int64)
        self._save_ring_header(t)
        h["head"] = head + k
        h["count"] = int(h["count"][0]) - k
        if self.quarantine:
            ids = self._release_quarantine(t, ids)
        h["allocs"] = int(h["allocs"][0]) + len(ids)
        crash_point("blocks.after_ring_pop")
        return ids

    def _release_quarantine(self, t: Txn, ids: np.ndarray) -> np.ndarray:
        """Send blocks freed fewer than `quarantine` allocations ago back to the tail, taking
        older free blocks instead; when only young ones are left, they are used anyway."""
        h = self.ring_header
        allocs = int(h["allocs"][0])
        young = (self.state[ids] == BlockState.QUARANTINED) & (
            allocs - self.blocks["freed_at"][ids].astype(np.int64) < self.quarantine
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
            (b,) = self.ring_pop_raw(t, 1)
            if (
                self.state[b] == BlockState.QUARANTINED
                and allocs - int(self.blocks["freed_at"][b]) < self.quarantine
            ):
                back = np.append(back, b)
            else:
                extra.append(int(b))
        got = np.concatenate([keep, np.asarray(extra, np.int64)])
        short = want - len(got)
        if short > 0:
            got, back = np.concatenate([got, back[:short]]), back[short:]
        self._push_raw(t, back)
        return got

    def ring_pop_raw(self, t: Txn, k: int) -> np.ndarray:
        """Pop k ids from the head with no quarantine rule (the caller holds the free lock)."""
        h = self.ring_header
        head = int(h["head"][0])
        ids = self.ring[(head + np.arange(k)) % self.num_blocks].astype(np.int64)
        h["head"] = head + k
        h["count"] = int(h["count"][0]) - k
        return ids

    def ring_push(self, t: Txn, ids: np.ndarray, state: BlockState = BlockState.FREE) -> None:
        """Return blocks to the ring tail as FREE (QUARANTINED in guard mode)."""
        t.need(self.free_lock)
        k = len(ids)
        if k == 0:
            return
        self.save(t, ids)
        self.state[ids] = state
        self.refcount[ids] = 0
        self.indexed[ids] = 0
        # owner_pid and request stay: the last owner of a free block, for post-mortems.
        self.blocks["owner_client"][ids] = -1
        self.seal(ids)
        crash_point("blocks.after_release_records")
        if state == BlockState.QUARANTINED:
            self.blocks["freed_at"][ids] = int(self.ring_header["allocs"][0])
        self._push_raw(t, ids)
        crash_point("blocks.after_ring_push")

    def _push_raw(self, t: Txn, ids: np.ndarray) -> None:
        """Append ids at the ring tail (journaled; records unchanged)."""
        k = len(ids)
        if k == 0:
            return
        h = self.ring_header
        tail = int(h["tail"][0])
        self._save_ring_header(t)
        pos = (tail + np.arange(k)) % self.num_blocks
        first = tail % self.num_blocks
        n1 = min(k, self.num_blocks - first)
        t.journal.save(self.ring_off + RING_HEADER_DTYPE.itemsize + 4 * first, 4 * n1)
        if n1 < k:
            t.journal.save(self.ring_off + RING_HEADER_DTYPE.itemsize, 4 * (k - n1))
        self.ring[pos] = ids
        h["tail"] = tail + k
        h["count"] = int(h["count"][0]) + k
