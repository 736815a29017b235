"""Allocating a sequence for a prompt: its prefix keys, the longest verified prefix hit it
shares, new blocks for the rest, and undoing the first half of a split allocation. The Python
path of `KVPool.allocate` (pool.py), which tries the C core first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.crash import crash_point
from kvscope.allocator.errors import PoolError, PoolExhausted
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import CHUNK, BlockState
from kvscope.allocator.prefix import chain_hashes
from kvscope.allocator.process import now_ns
from kvscope.allocator.publish import chain_keys
from kvscope.allocator.reserve import exhausted, fill, take, take_locks
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def allocate(pool: KVPool, request_id: object, tokens: list[int]) -> Sequence:
    """Reserve blocks for a prompt, reusing cached prefix blocks; returns its Sequence, which
    holds the hits and at most CHUNK new blocks (KVPool.allocate appends the rest)."""
    # (a function of its own, apart from the C core's dispatch: its closures' cells cost every
    # call)
    pool._check_process()
    tokens = list(map(int, tokens))
    if not tokens:
        raise PoolError("allocate needs at least one token")
    bs = pool.block_size
    n_blocks = -(-len(tokens) // bs)
    if n_blocks > pool.view.layout.max_blocks_per_seq:
        raise PoolError(
            f"a prompt of {len(tokens)} tokens needs {n_blocks} blocks; PoolConfig.max_blocks_per_seq is {pool.view.layout.max_blocks_per_seq}"
        )
    chain = [int(x) for x in chain_hashes(np.asarray(tokens), bs)]
    index = pool.store.index
    keys = chain_keys(index, chain)
    max_hits = (len(tokens) - 1) // bs
    shards = {pool.SHARDS[index.shard(k)] for k in keys[:max_hits]}
    claim_locks = shards if pool.seqtab.can_claim_locally() else {pool.SEQS} | shards
    rb = request_bytes(request_id)
    site = pool._site()
    # A prompt with a full block looks itself up in the index under the shard locks of its
    # keys: it takes its hits in one transaction and its new blocks in a second, so other
    # processes wait for those locks only while the hits are taken; a failure in the
    # second undoes the first.
    split = max_hits > 0
    # The hits' last-use times before the claim took them: a failed allocation puts them back.
    hits_ns: np.ndarray | None = None

    def claim(t: Txn) -> tuple[int, int, list[int]]:
        nonlocal hits_ns
        slot, seq_id = pool.seqtab.claim(t, rb, pool.pid, pool.start, pool.client, site)
        hits, hits_ns = _match(pool, t, keys, tokens, max_hits, rb)
        if split:
            pool.seqtab.write_blocks(t, slot, 0, hits)
            pool.view.seqs["num_tokens"][slot] = len(hits) * bs
        return slot, seq_id, hits

    def grow(t: Txn, slot: int, seq_id: int, hits: list[int]) -> Sequence:
        first = min(n_blocks, len(hits) + CHUNK)
        new = take(pool, t, first - len(hits), rb, site=site)
        if faults.ARMED and len(new) and faults.fire("refcount-skew"):
            # A reference taken twice: the refcount no longer matches the block tables.
            pool.store.save(t, new[:1])
            pool.view.blocks["refcount"][new[:1]] += 1
            pool.store.seal(new[:1])
        if pool.probe is not None:
            pool.probe.event(t, EventOp.PREFIX_HIT, hits, rb)
            pool.probe.event(t, EventOp.ALLOCATE, new, rb, arg=seq_id)
            if len(hits) < max_hits:
                pool.probe.event(t, EventOp.PREFIX_MISS, [], rb, arg=max_hits - len(hits))
        table = hits + new.tolist()
        done = len(hits) if split else 0
        pool.seqtab.write_blocks(t, slot, done, table[done:])
        fill(pool, table, len(hits) * bs, tokens[len(hits) * bs : first * bs])
        _set_hashes(pool, new, len(hits), chain, keys)
        pool.view.seqs["num_tokens"][slot] = min(len(tokens), first * bs)
        pool._count(t, "prefix_queries", max_hits)
        pool._count(t, "prefix_hits", len(hits))
        seq = Sequence(
            request_id=str(request_id),
            tokens=tokens[: first * bs],
            block_table=table,
            slot=slot,
            seq_id=seq_id,
            pool_uid=pool._uid,
            num_cached_tokens=len(hits) * bs,
            chain=chain[:first],
            num_published=len(hits),
        )
        pool._track(t, seq)
        return seq

    if not split:
        locks = claim_locks | take_locks(pool, min(n_blocks, CHUNK))
        seq = pool._run(locks, lambda t: grow(t, *claim(t)))
    else:
        slot, seq_id, hits = pool._run(claim_locks, claim)
        more = min(n_blocks, len(hits) + CHUNK) - len(hits)
        try:
            seq = pool._run(take_locks(pool, more), lambda t: grow(t, slot, seq_id, hits))
        except BaseException as e:
            _unclaim(pool, slot, hits, hits_ns)
            if isinstance(e, PoolExhausted):
                raise exhausted(pool, e.needed) from None
            raise
    return seq


def _unclaim(pool: KVPool, slot: int, hits: list[int], access_ns: np.ndarray | None) -> None:
    """Undo the first half of a split allocation: drop its hits (their last-use times as
    they were, `access_ns`), give its slot back."""
    ids = np.asarray(hits, np.int64)
    locks = pool.store.shard_locks_for(ids)
    if not pool.seqtab.can_release_locally(slot):
        locks.add(pool.SEQS)

    def op(t: Txn) -> None:
        zero, _ = pool.store.drop(t, ids)
        if access_ns is not None:
            pool.view.blocks["access_ns"][ids] = access_ns  # (saved by the drop)
        if len(zero):
            # Not reached while the hits stay indexed (an unreferenced one is CACHED).
            t.need(pool.FREE)
            pool.store.give_back(t, zero)
        pool.seqtab.write_blocks(t, slot, 0, [])
        pool.seqtab.release(t, slot)

    pool._run(locks, op)


def _match(
    pool: KVPool,
    t: Txn,
    keys: list[int],
    tokens: list[int],
    max_hits: int,
    request: bytes,
) -> tuple[list[int], np.ndarray | None]:
    """Longest verified prefix hit for `request`: take a reference on each hit block; the hits,
    and their last-use times before it (None without a hit)."""
    if max_hits <= 0:
        return [], None
    index = pool.store.index
    b = pool.view.blocks
    bs = pool.block_size
    hits: list[int] = []
    parent = 0
    for j in range(max_hits):
        key = keys[j]
        t.need(pool.SHARDS[index.shard(key)])
        blk = index.lookup(key)
        if blk < 0:
            break
        # A hash hit is trusted only if the stored tokens and parent key agree too.
        if not pool.store.holds_prefix(blk, key, parent, tokens[j * bs : (j + 1) * bs]):
            break
        hits.append(blk)
        parent = key
    if not hits:
        return hits, None
    ids = np.asarray(hits, np.int64)
    pool.store.save(t, ids)
    before = b["access_ns"][ids].copy()
    b["refcount"][ids] += 1
    b["state"][ids] = BlockState.ALLOCATED
    b["access_ns"][ids] = now_ns()
    pool.store.seal(ids)
    crash_point("prefix.after_hit")
    if pool.probe is not None:
        # (the request's first 32 bytes, as the segment and the core have them)
        seen = f"a prefix hit by request '{request.decode(errors='replace')}'"
        pool.probe.writes.verify_published(t, ids, seen)
    return hits, before


def _set_hashes(
    pool: KVPool, ids: np.ndarray, first_logical: int, chain: list[int], keys: list[int]
) -> None:
    """Record prefix and parent keys of full blocks among freshly filled ones (unindexed)."""
    b = pool.view.blocks
    n = min(len(ids), len(keys) - first_logical)
    if n > 4:
        js = np.arange(first_logical, first_logical + n)
        k = np.asarray(keys, np.uint64)
        b["prefix_hash"][ids[:n]] = k[js]
        b["parent_hash"][ids[:n]] = np.where(js > 0, k[js - 1], np.uint64(0))
    else:
        for i, blk in enumerate(ids[: max(n, 0)].tolist()):
            j = first_logical + i
            pool.store.set_hashes(blk, keys[j], keys[j - 1] if j else 0)
    if len(ids):
        pool.store.seal(ids)
