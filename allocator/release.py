"""Ending sequences: free, abort, the chunked release of long tables, and the faults that
strike when a request ends. Mixed into KVPool through SequenceOps."""

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
    from .surface import PoolSurface
else:
    PoolSurface = object

# The C core's end() takes the final state as a plain int.
_FINISHED, _ABORTED = int(SeqState.FINISHED), int(SeqState.ABORTED)


class ReleaseOps(PoolSurface):
    """Dropping a sequence's references (the `self` is always a KVPool)."""

    def _release_blocks(
        self,
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
        t.need(*self.store.shard_locks_for(ids))
        probe = self.probe
        rb = request_bytes(seq.request_id)
        if probe is not None and probe.flags.magic:
            # Never build on a record something else scribbled over: report it and leave it.
            bad = ids[block_checksums(self.view.blocks, ids) != self.view.blocks["checksum"][ids]]
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
        zero, already = self.store.drop(t, drop_ids)
        if probe is not None:
            for blk in already.tolist():
                rec = self.view.blocks[blk].copy()
                t.after_commit.append(
                    lambda blk=blk, rec=rec: probe.block_finding(  # type: ignore[misc]
                        FindingKind.DOUBLE_FREE,
                        blk,
                        f"block released by request {seq.request_id!r} but it was already free",
                        rec=rec,
                    )
                )
        if len(zero):
            if probe is not None and probe.flags.guard and self._guards(seq.slot):
                bad_guard = probe.scan_guard(zero)
                t.after_commit.append(lambda: probe.report_guard(bad_guard))
                # Poison only if the release commits: a rolled-back preemption keeps its KV.
                t.before_commit.append(lambda zero=zero: probe.poison(zero))  # type: ignore[misc]
                # Quarantine: freed blocks go to the tail of the FIFO ring, never the local cache.
                t.need(self.FREE)
                self.store.ring_push(t, zero, BlockState.QUARANTINED)
                probe.writes.quarantined(t, zero)
            else:
                if int(self.store.local_count[0]) + len(zero) > self.store.local_max:
                    t.need(self.FREE)
                self.store.give_back(t, zero)
        if not keep_table:
            self.seqtab.write_blocks(t, seq.slot, keep, [])
        if probe is not None:
            op = EventOp.ABORT if aborted else EventOp.FREE
            probe.event(t, op, drop_ids, rb)
        self._count(t, "num_frees", len(ids))
        return zero

    def free(self, seq: Sequence) -> None:
        """Release a finished sequence: shared blocks lose a reference, published ones stay cached."""
        if self.probe is not None and isinstance(seq, Sequence) and seq.slot >= 0:
            if self._guards(seq.slot):  # (in sampled guard mode, the sampled requests)
                self.probe.writes.finished(seq)
        if self._native is None or self._native.end(self, seq, _FINISHED) is None:
            self._end(seq, SeqState.FINISHED)

    def abort(self, seq: Sequence) -> None:
        """Release a sequence whose request did not finish."""
        if self._native is None or self._native.end(self, seq, _ABORTED) is None:
            self._end(seq, SeqState.ABORTED)

    def _end(self, seq: Sequence, final: SeqState) -> None:
        self._own_for_release(seq)
        # Long tables are released from the tail in chunks, each its own transaction.
        while len(seq.block_table) > CHUNK:
            keep = len(seq.block_table) - CHUNK
            self._release_tail(seq, keep, final == SeqState.ABORTED)
        table = list(seq.block_table)
        ids = np.asarray(table, np.int64)
        locks = self.store.shard_locks_for(ids)
        probe = self.probe
        guard = probe is not None and probe.flags.guard and self._guards(seq.slot)
        # Only private blocks come back free (published ones stay cached): the free lock is
        # needed when they overflow the local cache (a hint; the release escalates if not).
        if (
            guard
            or int(self.store.local_count[0]) + self.store.num_private(ids) > self.store.local_max
        ):
            locks.add(self.FREE)
        if probe is not None:
            probe.before_release(table, seq.request_id)
        skip, stale = self._end_faults(seq, ids)
        if not stale and not self.seqtab.can_release_locally(seq.slot):
            locks.add(self.SEQS)
        if faults.ARMED and locks:
            self._kill_fault()
        # Whether this release is the double-free fault's opportunity, decided once (a retried
        # transaction must not count it twice).
        double: list[bool] = [] if "double-free" in faults.ARMED else [False]

        def op(t: Txn) -> list:
            freed = self._release_blocks(
                t, seq, 0, skip=skip, keep_table=stale, aborted=final == SeqState.ABORTED
            )
            if not stale:
                self.view.seqs["state"][seq.slot] = final
                self.seqtab.release(t, seq.slot)
            if len(freed) and not double:
                double.append(faults.opportunity("double-free"))
            if len(freed) and double[0]:
                self._release_again(t, int(freed[-1]), seq.request_id)
            # Read inside the transaction: once it commits, what it freed is anyone's.
            return [] if probe is None else probe.held_after_release(table)

        held = self._run(locks, op)
        self._guarded.discard(seq.slot)
        self._seqs.pop(seq.slot, None)
        seq.block_table = []
        seq.state = final.name.lower()
        seq.slot = -1
        if probe is not None:
            probe.after_release(held, seq.request_id)

    def _own_for_release(self, seq: Sequence) -> None:
        """`_own`, and under the probes a second free or abort of one sequence is recorded as
        `double_free` before the library refuses it with PoolError."""
        if self.probe is not None and isinstance(seq, Sequence) and seq.slot < 0:
            if seq.pool_uid == self._uid and seq.state in ("finished", "aborted"):
                self.probe.double_end(seq)
        self._own(seq)

    def _end_faults(self, seq: Sequence, ids: np.ndarray) -> tuple[tuple[int, ...], bool]:
        """Faults that strike when a request ends: (blocks to leak, keep the stale table).

        Each waits for a request it can act on: `leak` for a block only this request holds
        (so nothing else frees it), `use-after-free` for one the release really frees.
        """
        if not faults.ARMED:
            return (), False
        b = self.view.blocks
        private = [int(x) for x in ids if not b["indexed"][x] and int(b["refcount"][x]) == 1]
        if private and faults.opportunity("leak"):
            faults.fired("leak")
            return (private[-1],), False
        if private and faults.opportunity("use-after-free"):
            # The request's blocks are freed but its table stays live and mapped.
            faults.fired("use-after-free")
            return (), True
        return (), False

    def _kill_fault(self) -> None:
        """`kill-holding-lock`: die (SIGKILL) right after this release has taken its locks."""
        if faults.opportunity("kill-holding-lock"):
            from kvscope.allocator import crash

            crash.configure("txn.after_locks:1")
            faults.fired("kill-holding-lock")

    def _release_again(self, t: Txn, blk: int, request: str) -> None:
        """The double-free fault: release a block this release has just freed a second time,
        in the same transaction (so no other process can have taken it in between)."""
        _, already = self.store.drop(t, np.array([blk], np.int64))
        assert already.tolist() == [blk], "a block just freed must read as already free"
        rec = self.view.blocks[blk].copy()
        probe = self.probe

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

    def _release_tail(self, seq: Sequence, keep: int, aborted: bool = False) -> None:
        ids = np.asarray(seq.block_table[keep:], np.int64)
        locks = self.store.shard_locks_for(ids) | {self.FREE}
        self._run(locks, lambda t: self._release_blocks(t, seq, keep, aborted=aborted))
        seq.block_table = seq.block_table[:keep]
