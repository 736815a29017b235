"""Preemption: a sequence is running or waiting (`set_state`); when the pool is full, taking
blocks frees this process's oldest waiting one (reserve.py), and `resume` re-reserves it. The
Python path of `KVPool.set_state`, `KVPool.resume` and of preemption (`preempt_one`, for
reserve.py's take): the C core does them itself (csrc/preempt.c) and hands back only what it
does not run (a waiting sequence guard mode guards; a handle on the Python
path: an armed fault or crash point, KVSCOPE_NATIVE=0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.allocator.errors import PoolError
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import SeqState
from kvscope.allocator.release import release_blocks
from kvscope.allocator.sequence import STATE_NAMES, Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def set_state(pool: KVPool, seq: Sequence, state: str) -> None:
    """Mark a sequence running or waiting (only waiting ones may be preempted)."""
    pool._own(seq)
    if state not in ("running", "waiting"):
        raise PoolError(f"set_state takes 'running' or 'waiting', got {state!r}")
    if seq.state == "preempted":
        raise PoolError("a preempted sequence must be resumed with pool.resume(seq) first")
    pool.view.seqs["state"][seq.slot] = STATE_NAMES[state]
    seq.state = state


def resume(pool: KVPool, seq: Sequence) -> int:
    """Re-reserve blocks for a preempted sequence's tokens; returns its cached-token count."""
    pool._own(seq)
    if seq.state != "preempted":
        raise PoolError(f"resume needs a preempted sequence, this one is {seq.state}")
    tokens = list(seq.tokens)
    fresh = pool.allocate(seq.request_id, tokens)
    # Move the fresh sequence's slot into place of the old one.
    old_slot = seq.slot
    locks = set() if pool.seqtab.can_release_locally(old_slot) else {pool.SEQS}

    def move(t: Txn) -> None:
        pool.seqtab.release(t, old_slot)
        pool._untrack(t, old_slot)
        pool._track(t, seq, fresh.slot)

    pool._run(locks, move)
    seq.slot, seq.seq_id, seq.block_table = fresh.slot, fresh.seq_id, fresh.block_table
    seq.chain, seq.num_published = fresh.chain, fresh.num_published
    seq.num_cached_tokens, seq.state = fresh.num_cached_tokens, "running"
    return seq.num_cached_tokens


def preempt_one(pool: KVPool, t: Txn, exclude: int) -> bool:
    """Free the blocks of this process's oldest waiting sequence (not `exclude`, the slot
    being grown); False if there is none."""
    # The segment's state, not the Python one: it is rolled back with the transaction.
    states = pool.view.seqs["state"]
    waiting = [
        s
        for s in pool.live().values()
        if states[s.slot] == SeqState.WAITING and s.block_table and s.slot != exclude
    ]
    if not waiting:
        return False
    seq = min(waiting, key=lambda s: s.seq_id)
    if pool.probe is not None:
        pool.probe.event(t, EventOp.PREEMPT, seq.block_table, request_bytes(seq.request_id))
    release_blocks(pool, t, seq, 0)
    pool.view.seqs["state"][seq.slot] = SeqState.PREEMPTED
    pool._count(t, "num_preemptions")

    def done() -> None:
        seq.block_table = []
        seq.state = "preempted"
        seq.num_published = 0

    t.after_commit.append(done)
    return True
