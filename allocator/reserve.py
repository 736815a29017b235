"""Taking blocks for a sequence: the local cache, the free ring, eviction, preemption
(preempt.py); and writing token ids into them. Used by allocate.py and append.py (the Python path:
the C core's take is csrc/blocks.c `take`, its preemption and PoolExhausted csrc/preempt.c)."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.errors import PoolExhausted
from kvscope.allocator.layout import EVICT_BATCH, BlockState, ClientState, SeqState
from kvscope.allocator.preempt import preempt_one
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool

# Journal room (entries, bytes) an eviction inside `take` leaves, besides the stamp of the
# blocks taken, for the rest of the operation: the ring's header and slots, the sequence's
# head and table, an event (a bound for the common case: more raises JournalFull, and the
# operation runs again after the C core evicted ahead; the core's take keeps the same room:
# csrc/eviction.c TAKE_SLACK).
TAKE_SLACK = (16, 8192)


def take(
    pool: KVPool, t: Txn, n: int, request: bytes, exclude: int = -1, site: int = -1
) -> np.ndarray:
    """n fresh ALLOCATED blocks owned by this client: local cache, ring, eviction, preemption."""
    got = [pool.store.local_pop(t, n)]
    short = n - len(got[0])
    if short > 0:
        t.need(pool.FREE)
        got.append(pool.store.ring_pop(t, short))
        short -= len(got[-1])
        if short == 0:
            pool.store.refill(t, pool.pid, pool.start)
    if short > 0:
        # Eviction needs every shard; preemption only touches this process's own slots.
        t.need(pool.FREE, *pool.SHARDS)
        # Evict a batch: finding the LRU blocks scans the whole pool, so amortize it; the
        # extra evicted blocks go to the free ring. The eviction keeps journal room for what
        # follows (the stamp of the n blocks, the extra ones' return to the ring, the
        # caller's sequence writes): the extra blocks stop where the room ends, and when the
        # `short` needed do not fit, the operation is rolled back and run again after they
        # are evicted ahead by the C core (eviction.evict_ahead, runner.py).
        rec = pool.store.record_size
        keep = (n + TAKE_SLACK[0], n * rec + TAKE_SLACK[1])
        evicted = pool.store.evict(t, short, extra=EVICT_BATCH, keep=keep, to_ring=short)
        got.append(evicted[:short])
        pool.store.ring_push(t, evicted[short:])
        short -= len(got[-1])
        pool._count(t, "num_evictions", len(evicted))
        # Preempted blocks land in the local cache, the ring, or stay cached (indexed).
        while short > 0 and preempt_one(pool, t, exclude):
            for source in (pool.store.local_pop, pool.store.ring_pop, pool.store.evict):
                more = (
                    pool.store.evict(t, short, keep=keep)
                    if source == pool.store.evict
                    else source(t, short)
                )
                got.append(more)
                short -= len(more)
                if source == pool.store.evict:
                    pool._count(t, "num_evictions", len(more))
                if short == 0:
                    break
    if short > 0:
        raise exhausted(pool, n)
    ids = np.concatenate(got) if len(got) > 1 else got[0]
    pool._count(t, "num_allocs", len(ids))
    probe = pool.probe
    if probe is not None:
        probe.writes.before_reuse(t, ids, request)
    pool.store.stamp(t, ids, pool.pid, pool.start, request, site)
    if probe is not None:
        probe.writes.reused(t, ids)
    return ids


def take_locks(pool: KVPool, n: int) -> set[int]:
    """The locks `take(pool, t, n)` will need, judged from the local cache and the ring's count
    (a hint): when both are short, eviction's locks are taken up front rather than by a
    rolled-back first attempt."""
    local = int(pool.store.local_count[0])
    if local >= n:
        return set()
    if local + pool.store.ring_count >= n:
        return {pool.FREE}
    return {pool.FREE, *pool.SHARDS}


def exhausted(pool: KVPool, needed: int) -> PoolExhausted:
    """The error for a take of `needed` blocks: what is free, cached and held, and by whom."""
    st = np.bincount(pool.view.blocks["state"], minlength=len(BlockState))
    seqs = pool.view.seqs
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    holders: dict[str, int] = {}
    for s in live.tolist():
        r = seqs["request"][s].decode(errors="replace")
        holders[r] = holders.get(r, 0) + int(seqs["num_blocks"][s])
    # Free blocks this process cannot take: other processes' local caches (private, no lock).
    cl = pool.view.clients
    elsewhere: dict[int, int] = {}
    attached = (cl["state"] == ClientState.ATTACHED) & (cl["local_count"] > 0)
    for c in np.flatnonzero(attached).tolist():
        if c != pool.client:
            pid = int(cl["pid"][c])
            elsewhere[pid] = elsewhere.get(pid, 0) + int(cl["local_count"][c])
    return PoolExhausted(
        needed=needed,
        free=int(st[BlockState.FREE] + st[BlockState.LOCAL] + st[BlockState.QUARANTINED]),
        cached=int(st[BlockState.CACHED]),
        held=int(st[BlockState.ALLOCATED]),
        holders=holders,
        elsewhere=elsewhere,
    )


def fill(pool: KVPool, ids: list[int], first_pos: int, tokens: list[int]) -> None:
    """Write token ids into blocks covering positions [first_pos, first_pos+len(tokens))."""
    bs = pool.block_size
    st = pool.store
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
