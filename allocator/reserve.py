"""Taking blocks for a sequence: the local cache, the free ring, eviction, preemption.
Mixed into KVPool through SequenceOps."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.errors import PoolExhausted
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import EVICT_BATCH, BlockState, SeqState
from kvscope.allocator.sequence import request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from .surface import PoolSurface
else:
    PoolSurface = object


class ReserveOps(PoolSurface):
    """Block reservation (the `self` is always a KVPool)."""

    def _take(
        self, t: Txn, n: int, request: bytes, exclude: int = -1, site: int = -1
    ) -> np.ndarray:
        """n fresh ALLOCATED blocks owned by this client: local cache, ring, eviction, preemption."""
        got = [self.store.local_pop(t, n)]
        short = n - len(got[0])
        if short > 0:
            t.need(self.FREE)
            got.append(self.store.ring_pop(t, short))
            short -= len(got[-1])
            if short == 0:
                self.store.refill(t, self.pid, self.start)
        if short > 0:
            # Eviction needs every shard; preemption only touches this process's own slots.
            t.need(self.FREE, *self.SHARDS)
            # Evict a batch: finding the LRU blocks scans the whole pool, so amortize it; the
            # extra evicted blocks go to the free ring.
            evicted = self.store.evict(t, short, extra=EVICT_BATCH)
            got.append(evicted[:short])
            self.store.ring_push(t, evicted[short:])
            short -= len(got[-1])
            self._count(t, "num_evictions", len(evicted))
            # Preempted blocks land in the local cache, the ring, or stay cached (indexed).
            while short > 0 and self._preempt_one(t, exclude):
                for source in (self.store.local_pop, self.store.ring_pop, self.store.evict):
                    more = source(t, short)
                    got.append(more)
                    short -= len(more)
                    if source == self.store.evict:
                        self._count(t, "num_evictions", len(more))
                    if short == 0:
                        break
        if short > 0:
            raise self._exhausted(n)
        ids = np.concatenate(got) if len(got) > 1 else got[0]
        self._count(t, "num_allocs", len(ids))
        probe = self.probe
        if probe is not None:
            probe.writes.before_reuse(t, ids, request)
        self.store.stamp(t, ids, self.pid, self.start, request, site)
        if probe is not None:
            probe.writes.reused(t, ids)
        return ids

    def _take_locks(self, n: int) -> set[int]:
        """The locks `_take(t, n)` will need, judged from the local cache and the ring's count
        (a hint): when both are short, eviction's locks are taken up front rather than by a
        rolled-back first attempt."""
        local = int(self.store.local_count[0])
        if local >= n:
            return set()
        if local + self.store.ring_count >= n:
            return {self.FREE}
        return {self.FREE, *self.SHARDS}

    def _preempt_one(self, t: Txn, exclude: int) -> bool:
        """Free the blocks of this process's oldest waiting sequence (not `exclude`, the slot
        being grown); False if there is none."""
        # The segment's state, not the Python one: it is rolled back with the transaction.
        states = self.view.seqs["state"]
        waiting = [
            s
            for s in self._seqs.values()
            if states[s.slot] == SeqState.WAITING and s.block_table and s.slot != exclude
        ]
        if not waiting:
            return False
        seq = min(waiting, key=lambda s: s.seq_id)
        if self.probe is not None:
            self.probe.event(t, EventOp.PREEMPT, seq.block_table, request_bytes(seq.request_id))
        self._release_blocks(t, seq, 0)
        self.view.seqs["state"][seq.slot] = SeqState.PREEMPTED
        self._count(t, "num_preemptions")

        def done() -> None:
            seq.block_table = []
            seq.state = "preempted"
            seq.num_published = 0

        t.after_commit.append(done)
        return True

    def _exhausted(self, needed: int) -> PoolExhausted:
        st = np.bincount(self.view.blocks["state"], minlength=len(BlockState))
        seqs = self.view.seqs
        live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
        holders: dict[str, int] = {}
        for s in live.tolist():
            r = seqs["request"][s].decode(errors="replace")
            holders[r] = holders.get(r, 0) + int(seqs["num_blocks"][s])
        return PoolExhausted(
            needed=needed,
            free=int(st[BlockState.FREE] + st[BlockState.LOCAL]),
            cached=int(st[BlockState.CACHED]),
            held=int(st[BlockState.ALLOCATED]),
            holders=holders,
        )

    def _fill(self, ids: list[int], first_pos: int, tokens: list[int]) -> None:
        """Write token ids into blocks covering positions [first_pos, first_pos+len(tokens))."""
        bs = self.block_size
        st = self.store
        i32, u32, rec4 = st.i32, st.u32, st.rec4
        tokens_at4, num_tokens_at4 = st.tokens_at4, st.num_tokens_at4
        pos = first_pos
        i = 0
        total = len(tokens)
        if pos % bs == 0 and total >= 2 * bs:
            # Whole blocks (a prompt): one numpy copy.
            full = total // bs
            whole = np.asarray(ids[pos // bs : pos // bs + full], np.int64)
            st.tokens[whole] = np.asarray(tokens[: full * bs], np.int32).reshape(full, bs)
            st.num_tokens[whole] = bs
            pos += full * bs
            i = full * bs
        while i < total:
            blk = ids[pos // bs]
            off = pos % bs
            n = min(bs - off, total - i)
            at = tokens_at4 + blk * rec4 + off
            if n == 1:
                i32[at] = tokens[i]
            else:
                i32[at : at + n] = array("i", tokens[i : i + n])
            u32[num_tokens_at4 + blk * rec4] = off + n
            pos += n
            i += n
