"""Growing a sequence: token appends, copy-on-write of a shared last block, and the prefix keys
of blocks as they fill. The Python path of `KVPool.append` (pool.py), which tries the C core
first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.crash import crash_point
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import CHUNK
from kvscope.allocator.prefix import chain_one
from kvscope.allocator.publish import chain_key
from kvscope.allocator.reserve import fill, take, take_locks
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def append(pool: KVPool, seq: Sequence, tokens: list[int]) -> list[tuple[int, int]]:
    """Append tokens; returns the copy-on-write (src, dst) block copies to perform first."""
    pool._own(seq)
    tokens = list(map(int, tokens))
    if not tokens:
        return []
    if len(tokens) <= pool.block_size:
        return _append_chunk(pool, seq, tokens)
    copies: list[tuple[int, int]] = []
    done = 0
    while done < len(tokens):
        part = tokens[done : done + CHUNK * pool.block_size]
        copies += _append_chunk(pool, seq, part)
        done += len(part)
    return copies


def _append_chunk(pool: KVPool, seq: Sequence, tokens: list[int]) -> list[tuple[int, int]]:
    bs = pool.block_size
    n_old = len(seq.tokens)
    n_new = n_old + len(tokens)
    need_blocks = -(-n_new // bs) - len(seq.block_table)
    b = pool.view.blocks
    last = seq.block_table[-1] if seq.block_table else -1
    st = pool.store
    cow = n_old % bs != 0 and last >= 0 and st.i32[st.refcount_at4 + last * st.rec4] > 1
    if need_blocks <= 0 and not cow:
        # Fast path: the tokens fit in the last block, which only this sequence uses (the
        # decode step: a write of the token, its count and the sequence's length).
        if len(tokens) == 1 and n_old % bs:
            off = n_old % bs
            at = last * st.rec4
            st.i32[st.tokens_at4 + at + off] = tokens[0]
            st.u32[st.num_tokens_at4 + at] = off + 1
        else:
            fill(pool, seq.block_table, n_old, tokens)
        seq.tokens.extend(tokens)
        sq = pool.seqtab
        sq.u64[sq.num_tokens_at8 + seq.slot * sq.rec8] = n_new
        if n_new // bs > len(seq.chain):
            _extend_chain(pool, seq)
        return []
    locks = take_locks(pool, max(0, need_blocks) + cow)
    if cow and b["indexed"][last]:
        locks |= pool.store.shard_locks_for(np.array([last]))
    rb = request_bytes(seq.request_id)
    site = pool._site()

    def op(t: Txn) -> tuple[list[int], list[tuple[int, int]]]:
        table = list(seq.block_table)
        copies: list[tuple[int, int]] = []
        if cow:
            (dst,) = take(pool, t, 1, rb, seq.slot, site).tolist()
            src = table[-1]
            b["tokens"][dst] = b["tokens"][src]
            b["num_tokens"][dst] = b["num_tokens"][src]
            # src stays shared (refcount > 1), unless taking dst preempted its other holders:
            # then it has no reference left, and is cached (published) or given back
            zero, _ = pool.store.drop(t, np.array([src]))
            if len(zero):
                t.need(pool.FREE)
                pool.store.give_back(t, zero)
            pool.seqtab.set_blocks(t, seq.slot, len(table) - 1, dst)
            pool.store.seal(np.array([dst]))
            table[-1] = dst
            copies.append((src, dst))
            if pool.probe is not None:
                pool.probe.event(t, EventOp.ALLOCATE, [dst], rb, arg=seq.seq_id)
                pool.probe.event(t, EventOp.COW, [src], rb, arg=dst)
            pool._count(t, "num_cow")
        if need_blocks > 0:
            new = take(pool, t, need_blocks, rb, seq.slot, site)
            pool.seqtab.write_blocks(t, seq.slot, len(table), new.tolist())
            if pool.probe is not None:
                pool.probe.event(t, EventOp.ALLOCATE, new, rb, arg=seq.seq_id)
            table += new.tolist()
        fill(pool, table, n_old, tokens)
        pool.view.seqs["num_tokens"][seq.slot] = n_new
        return table, copies

    table, copies = pool._run(locks, op)
    seq.block_table = table
    seq.tokens.extend(tokens)
    _extend_chain(pool, seq)
    if faults.ARMED:
        _append_faults(pool, seq)
    return copies


def _append_faults(pool: KVPool, seq: Sequence) -> None:
    """Faults that strike while a sequence grows: a KV write past its block, scribbles."""
    if faults.fire("oob-write"):
        faults.write_past(pool, seq.block_table[-1])
    if faults.fire("header-scribble"):
        fields = pool.view.header.dtype.fields
        assert fields is not None  # a structured dtype
        off = fields["num_blocks"][1]
        pool.view.raw[off : off + 4] = np.frombuffer(b"\xde\xad\xbe\xef", np.uint8)
    if faults.fire("block-scribble"):
        blk = seq.block_table[0]
        # Raw bytes over the refcount, not through the allocator: the checksum no longer matches.
        pool.view.blocks["refcount"][blk] = 0x5A5A5A5A


def _extend_chain(pool: KVPool, seq: Sequence) -> None:
    """Hash blocks that became full (their keys are recorded, not yet indexed)."""
    bs = pool.block_size
    b = pool.view.blocks
    index = pool.store.index
    full = len(seq.tokens) // bs
    while len(seq.chain) < full:
        j = len(seq.chain)
        prev = seq.chain[-1] if j else 0
        h = chain_one(prev, seq.tokens[j * bs : (j + 1) * bs])
        seq.chain.append(h)
        blk = seq.block_table[j]
        if not b["indexed"][blk] and int(b["refcount"][blk]) == 1:
            key = chain_key(index, seq.chain, j)
            _set_keys(pool, blk, key, chain_key(index, seq.chain, j - 1) if j else 0)


def _set_keys(pool: KVPool, blk: int, key: int, parent: int) -> None:
    """Record a full block's prefix and parent keys (an unindexed block of our own: no lock).

    The key is checksummed: key and checksum go in one 16-byte store, so a kill at any
    point leaves the record sealed; the parent key is outside the checksum.
    """
    pool.store.set_prefix_key(blk, key)
    crash_point("seqs.after_prefix_key")
    pool.view.blocks["parent_hash"][blk] = parent
