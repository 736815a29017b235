"""Forking a sequence: a new sequence sharing every block of its parent (n > 1 samples, beam
search); the first write into a shared partial block is copied (append.py). The Python path of
`KVPool.fork` (pool.py), which tries the C core first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.events import EventOp
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def fork(pool: KVPool, seq: Sequence, request_id: object) -> Sequence:
    """A new sequence sharing every block of seq (refcounts +1)."""
    pool._own(seq)
    ids = np.asarray(seq.block_table, np.int64)
    locks = pool.store.shard_locks_for(ids)
    if not pool.seqtab.can_claim_locally():
        locks.add(pool.SEQS)
    rb = request_bytes(request_id)
    site = pool._site()

    def op(t: Txn) -> Sequence:
        slot, seq_id = pool.seqtab.claim(t, rb, pool.pid, pool.start, pool.client, site)
        if len(ids):
            pool.store.save(t, ids)
            pool.view.blocks["refcount"][ids] += 1
            pool.store.seal(ids)
        pool.seqtab.write_blocks(t, slot, 0, ids)
        pool.view.seqs["num_tokens"][slot] = len(seq.tokens)
        if pool.probe is not None:
            pool.probe.event(t, EventOp.FORK, ids, rb, arg=seq.seq_id)
        pool._count(t, "num_forks")
        child = Sequence(
            request_id=str(request_id),
            tokens=list(seq.tokens),
            block_table=list(seq.block_table),
            slot=slot,
            seq_id=seq_id,
            pool_uid=pool._uid,
            num_cached_tokens=seq.num_cached_tokens,
            chain=list(seq.chain),
            num_published=seq.num_published,
        )
        pool._track(t, child)
        return child

    return pool._run(locks, op)
