"""Publishing: `mark_computed` puts a sequence's full blocks in the prefix index, so other
requests and processes can hit them; and the index keys of a chain's blocks. The Python path of
`KVPool.mark_computed` (pool.py), which tries the C core first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.events import EventOp
from kvscope.allocator.prefix import PrefixIndex, family_key, family_keys, key_of, keys_of
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def mark_computed(pool: KVPool, seq: Sequence, num_tokens: int) -> int:
    """Publish the full blocks of positions [0, num_tokens); return how many."""
    pool._own(seq)
    bs = pool.block_size
    upto = min(num_tokens, len(seq.tokens)) // bs
    todo = list(range(seq.num_published, upto))
    if not todo:
        return 0
    store = pool.store
    keys = [chain_key(store.index, seq.chain, j) for j in todo]
    blocks = [seq.block_table[j] for j in todo]
    shard_of = store.index.shard
    locks = {pool.SHARDS[shard_of(k)] for k in keys}

    def op(t: Txn) -> int:
        done: list[int] = []
        for j, key, blk in zip(todo, keys, blocks):
            if store.is_indexed(blk):
                continue
            if store.refcount_of(blk) != 1:
                # Shared through fork, not through the index: leave it private.
                continue
            if store.index.insert(key, blk, t.journal):
                store.publish(t, blk, key, chain_key(store.index, seq.chain, j - 1) if j else 0)
                done.append(blk)
        if pool.probe is not None:
            pool.probe.writes.published(t, done)
            if done:
                pool.probe.event(t, EventOp.PUBLISH, done, request_bytes(seq.request_id))
        return len(done)

    n = pool._run(locks, op)
    seq.num_published = upto
    return n


def chain_keys(index: PrefixIndex, chain: list[int]) -> list[int]:
    """Index keys of a prompt's chain values (`prefix.family_keys`: one shard per prompt)."""
    if not chain:
        return []
    keys = keys_of(np.asarray(chain, np.uint64))
    return family_keys(keys, index.num_shards - 1).tolist()


def chain_key(index: PrefixIndex, chain: list[int], j: int) -> int:
    """Index key of block j of a chain (scalar twin of `chain_keys`)."""
    return family_key(key_of(chain[j]), key_of(chain[0]), index.num_shards - 1)
