"""Ending sequences: free, abort, the chunked release of long tables, and the faults that
strike when a request ends. Mixed into KVPool through SequenceOps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import BlockState, SeqState, block_checksums
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from .surface import PoolSurface
else:
    PoolSurface = object

# A free of a long sequence commits in chunks so one journal never overflows.
CHUNK = 128
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
    ) -> None:
        """Drop seq's references to table[keep:] (the caller holds the needed locks)."""
        ids = np.asarray(seq.block_table[keep:], np.int64)
        t.need(*self.store.shard_locks_for(ids))
        probe = self.probe
        rb = request_bytes(seq.request_id)
        if probe is not None and probe.flags.magic:
            # Never build on a record something else scribbled over: report it and leave it.
            bad = ids[block_checksums(self.view.blocks, ids) != self.view.blocks["checksum"][ids]]
            for blk in bad.tolist():
                t.after_commit.append(
                    lambda blk=blk: probe.block_finding(
                        "block_header_corrupt",
                        blk,
                        "block record checksum mismatch when its request released it: its header was overwritten outside the allocator",
                    )
                )
            ids = ids[~np.isin(ids, bad)]
        drop_ids = ids[~np.isin(ids, skip)] if skip else ids
        zero, already = self.store.drop(t, drop_ids)
        for blk in already.tolist():
            if probe is not None:
                t.after_commit.append(
                    lambda blk=blk: probe.block_finding(
                        "double_free",
                        blk,
                        f"block released by request {seq.request_id!r} but it was already free",
                    )
                )
        if len(zero):
            if probe is not None and probe.flags.guard:
                bad_guard = probe.scan_guard(zero)
                t.after_commit.append(lambda: probe.report_guard(bad_guard))
                # Poison only if the release commits: a rolled-back preemption keeps its KV.
                t.before_commit.append(lambda zero=zero: probe.poison(zero))
                # Quarantine: freed blocks go to the tail of the FIFO ring, never the local cache.
                t.need(self.FREE)
                self.store.ring_push(t, zero, BlockState.QUARANTINED)
            else:
                if int(self.store.local_count[0]) + len(zero) > self.store.local_max:
                    t.need(self.FREE)
                self.store.give_back(t, zero)
        if not keep_table:
            self.seqtab.write_blocks(t, seq.slot, keep, [])
        if probe is not None:
            op = EventOp.ABORT if seq.state == "aborted" else EventOp.FREE
            probe.event(t, op, drop_ids, rb)
        self._count(t, "num_frees", len(ids))

    def free(self, seq: Sequence) -> None:
        """Release a finished sequence: shared blocks lose a reference, published ones stay cached."""
        if self._native is None or self._native.end(self, seq, _FINISHED) is None:
            self._end(seq, SeqState.FINISHED)

    def abort(self, seq: Sequence) -> None:
        """Release a sequence whose request did not finish."""
        if self._native is None or self._native.end(self, seq, _ABORTED) is None:
            self._end(seq, SeqState.ABORTED)

    def _end(self, seq: Sequence, final: SeqState) -> None:
        self._own(seq)
        # Long tables are released from the tail in chunks, each its own transaction.
        while len(seq.block_table) > CHUNK:
            keep = len(seq.block_table) - CHUNK
            self._release_tail(seq, keep)
        table = list(seq.block_table)
        ids = np.asarray(table, np.int64)
        locks = self.store.shard_locks_for(ids)
        guard = self.probe is not None and self.probe.flags.guard
        # Only private blocks come back free (published ones stay cached): the free lock is
        # needed when they overflow the local cache (a hint; the release escalates if not).
        if (
            guard
            or int(self.store.local_count[0]) + self.store.num_private(ids) > self.store.local_max
        ):
            locks.add(self.FREE)
        if self.probe is not None:
            self.probe.before_release(table, seq.request_id)
        skip, stale = self._end_faults(seq, ids)
        if not stale and not self.seqtab.can_release_locally(seq.slot):
            locks.add(self.SEQS)

        def op(t: Txn) -> None:
            self._release_blocks(t, seq, 0, skip=skip, keep_table=stale)
            if not stale:
                self.view.seqs["state"][seq.slot] = final
                self.seqtab.release(t, seq.slot)

        self._run(locks, op)
        self._seqs.pop(seq.slot, None)
        seq.block_table = []
        seq.state = final.name.lower()
        seq.slot = -1
        if self.probe is not None:
            self.probe.after_release(table, seq.request_id)
        if faults.ARMED and faults.fire("double-free"):
            self._release_again(table)

    def _end_faults(self, seq: Sequence, ids: np.ndarray) -> tuple[tuple[int, ...], bool]:
        """Faults that strike when a request ends: (blocks to leak, keep the stale table)."""
        if not faults.ARMED:
            return (), False
        own = [int(b) for b in ids if not self.view.blocks["indexed"][b]]
        if own and faults.fire("leak"):
            return (own[-1],), False
        if faults.fire("use-after-free"):
            # The request's blocks are freed but its table stays live and mapped.
            return (), True
        if faults.fire("kill-holding-lock"):
            from kvscope.allocator import crash

            crash.configure("txn.after_locks:1")
        return (), False

    def _release_again(self, table: list[int]) -> None:
        """The double-free fault: release one of a finished request's blocks a second time."""
        own = [b for b in table if self.view.blocks["state"][b] != BlockState.CACHED]
        if not own:
            return
        blk = np.array(own[-1:], np.int64)
        already = self._run({self.FREE}, lambda t: self.store.drop(t, blk)[1])
        if self.probe is not None:
            for b in already.tolist():
                self.probe.block_finding(
                    "double_free",
                    b,
                    "block released a second time after its request ended: it is already free",
                )

    def _release_tail(self, seq: Sequence, keep: int) -> None:
        ids = np.asarray(seq.block_table[keep:], np.int64)
        locks = self.store.shard_locks_for(ids) | {self.FREE}
        self._run(locks, lambda t: self._release_blocks(t, seq, keep))
        seq.block_table = seq.block_table[:keep]
