"""Ending sequences: free, abort, the chunked release of long tables, and the faults that
strike when a request ends. The Python path of `KVPool.free` and `KVPool.abort` (pool.py), which
try the C core first; `release_blocks` also serves preemption (preempt.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.events import EventOp
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import CHUNK, BlockState, SeqState, block_checksums
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def release_blocks(
    pool: KVPool,
    t: Txn,
    seq: Sequence,
    keep: int,
    *,
    skip: tuple[int, ...] = (),
    keep_table: bool = False,
    aborted: bool = False,
) -> np.ndarray:
    """Drop seq's references to table[keep:] (the caller holds the needed locks); returns
    the blocks this freed (unindexed, no reference left)."""
    ids = np.asarray(seq.block_table[keep:], np.int64)
    t.need(*pool.store.shard_locks_for(ids))
    probe = pool.probe
    rb = request_bytes(seq.request_id)
    if probe is not None and probe.flags.magic:
        # Never build on a record something else scribbled over: report it and leave it.
        bad = ids[block_checksums(pool.view.blocks, ids) != pool.view.blocks["checksum"][ids]]
        for blk in bad.tolist():
            t.after_commit.append(
                lambda blk=blk: probe.block_finding(  # type: ignore[misc]
                    FindingKind.BLOCK_HEADER_CORRUPT,
                    blk,
                    "block record checksum mismatch when its request released it: its header was overwritten outside the allocator",
                )
            )
        ids = ids[~np.isin(ids, bad)]
    drop_ids = ids[~np.isin(ids, skip)] if skip else ids
    if probe is not None:
        probe.writes.verify_published(t, drop_ids, f"its release by request {seq.request_id!r}")
    zero, already = pool.store.drop(t, drop_ids)
    if probe is not None:
        for blk in already.tolist():
            rec = pool.view.blocks[blk].copy()
            t.after_commit.append(
                lambda blk=blk, rec=rec: probe.block_finding(  # type: ignore[misc]
                    FindingKind.DOUBLE_FREE,
                    blk,
                    f"block released by request {seq.request_id!r} but it was already free",
                    rec=rec,
                )
            )
    if len(zero):
        if probe is not None and probe.flags.guard and pool._guards(seq.slot):
            probe.check_guard(t, zero)
            # Poison only if the release commits: a rolled-back preemption keeps its KV.
            t.before_commit.append(lambda zero=zero: probe.poison(zero))  # type: ignore[misc]
            # Quarantine: freed blocks go to the tail of the FIFO ring, never the local cache.
            t.need(pool.FREE)
            pool.store.ring_push(t, zero, BlockState.QUARANTINED)
            probe.writes.quarantined(t, zero)
        else:
            if int(pool.store.local_count[0]) + len(zero) > pool.store.local_max:
                t.need(pool.FREE)
            pool.store.give_back(t, zero)
    if not keep_table:
        pool.seqtab.write_blocks(t, seq.slot, keep, [])
    if probe is not None:
        op = EventOp.ABORT if aborted else EventOp.FREE
        probe.event(t, op, drop_ids, rb)
    pool._count(t, "num_frees", len(ids))
    return zero


def end(pool: KVPool, seq: Sequence, final: SeqState) -> None:
    """Release seq as FINISHED (`free`) or ABORTED (`abort`): every reference it holds."""
    _own_for_release(pool, seq)
    # Long tables are released from the tail in chunks, each its own transaction.
    while len(seq.block_table) > CHUNK:
        keep = len(seq.block_table) - CHUNK
        _release_tail(pool, seq, keep, final == SeqState.ABORTED)
    table = list(seq.block_table)
    ids = np.asarray(table, np.int64)
    locks = pool.store.shard_locks_for(ids)
    probe = pool.probe
    guard = probe is not None and probe.flags.guard and pool._guards(seq.slot)
    # Only private blocks come back free (published ones stay cached): the free lock is
    # needed when they overflow the local cache (a hint; the release escalates if not).
    if guard or int(pool.store.local_count[0]) + pool.store.num_private(ids) > pool.store.local_max:
        locks.add(pool.FREE)
    if probe is not None:
        probe.before_release(table, seq.request_id)
    skip, stale = _end_faults(pool, seq, ids)
    if not stale and not pool.seqtab.can_release_locally(seq.slot):
        locks.add(pool.SEQS)
    if faults.ARMED and locks:
        _kill_fault()
    # Whether this release is the double-free fault's opportunity, decided once (a retried
    # transaction must not count it twice).
    double: list[bool] = [] if "double-free" in faults.ARMED else [False]

    def op(t: Txn) -> list:
        freed = release_blocks(
            pool, t, seq, 0, skip=skip, keep_table=stale, aborted=final == SeqState.ABORTED
        )
        if not stale:
            pool.view.seqs["state"][seq.slot] = final
            pool.seqtab.release(t, seq.slot)
        if len(freed) and not double:
            double.append(faults.opportunity("double-free"))
        if len(freed) and double[0]:
            _release_again(pool, t, int(freed[-1]), seq.request_id)
        pool._untrack(t, seq.slot)
        # Read inside the transaction: once it commits, what it freed is anyone's.
        return [] if probe is None else probe.held_after_release(table)

    held = pool._run(locks, op)
    seq.block_table = []
    seq.state = final.name.lower()
    seq.slot = -1
    if probe is not None:
        probe.after_release(held, seq.request_id)


def _own_for_release(pool: KVPool, seq: Sequence) -> None:
    """`_own`, and under the probes a second free or abort of one sequence is recorded as
    `double_free` before the library refuses it with PoolError."""
    if pool.probe is not None and isinstance(seq, Sequence) and seq.slot < 0:
        if seq.pool_uid == pool._uid and seq.state in ("finished", "aborted"):
            pool.probe.double_end(seq)
    pool._own(seq)


def _end_faults(pool: KVPool, seq: Sequence, ids: np.ndarray) -> tuple[tuple[int, ...], bool]:
    """Faults that strike when a request ends: (blocks to leak, keep the stale table).

    Each waits for a request it can act on: `leak` for a block only this request holds
    (so nothing else frees it), `use-after-free` for one the release really frees.
    """
    if not faults.ARMED:
        return (), False
    b = pool.view.blocks
    private = [int(x) for x in ids if not b["indexed"][x] and int(b["refcount"][x]) == 1]
    if private and faults.opportunity("leak"):
        faults.fired("leak")
        return (private[-1],), False
    if private and faults.opportunity("use-after-free"):
        # The request's blocks are freed but its table stays live and mapped.
        faults.fired("use-after-free")
        return (), True
    return (), False


def _kill_fault() -> None:
    """`kill-holding-lock`: die (SIGKILL) right after this release has taken its locks."""
    if faults.opportunity("kill-holding-lock"):
        from kvscope.allocator import crash

        crash.configure("txn.after_locks:1")
        faults.fired("kill-holding-lock")


def _release_again(pool: KVPool, t: Txn, blk: int, request: str) -> None:
    """The double-free fault: release a block this release has just freed a second time,
    in the same transaction (so no other process can have taken it in between)."""
    _, already = pool.store.drop(t, np.array([blk], np.int64))
    assert already.tolist() == [blk], "a block just freed must read as already free"
    rec = pool.view.blocks[blk].copy()
    probe = pool.probe

    def done() -> None:
        faults.fired("double-free")
        if probe is not None:
            probe.block_finding(
                FindingKind.DOUBLE_FREE,
                blk,
                f"block released a second time after request {request!r} ended: it is already free",
                rec=rec,
            )

    t.after_commit.append(done)


def _release_tail(pool: KVPool, seq: Sequence, keep: int, aborted: bool = False) -> None:
    ids = np.asarray(seq.block_table[keep:], np.int64)
    locks = pool.store.shard_locks_for(ids) | {pool.FREE}
    pool._run(locks, lambda t: release_blocks(pool, t, seq, keep, aborted=aborted))
    seq.block_table = seq.block_table[:keep]
