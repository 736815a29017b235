"""Sequence: one request's view of its blocks, and the shared sequence table that records it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.allocator.crash import crash_point
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import REQUEST_BYTES, SegmentView, SeqState
from kvscope.allocator.process import now_ns
from kvscope.allocator.txn import Txn

STATE_NAMES = {s.name.lower(): s for s in SeqState}


def request_bytes(request_id: object) -> bytes:
    """The request id as stored in the segment (UTF-8, truncated to 32 bytes)."""
    return str(request_id).encode()[:REQUEST_BYTES]


@dataclass(eq=False, slots=True)
class Sequence:
    """A live sequence of one pool, owned by the process that allocated it.

    It has `__slots__`: the C core (allocator/_native.c) builds and updates it at its slots'
    offsets.
    """

    request_id: str
    tokens: list[int]
    block_table: list[int]
    slot: int
    seq_id: int
    pool_uid: int
    num_cached_tokens: int = 0
    state: str = "running"
    # Linear chain values of the full blocks (prefix.py), and how many are published.
    chain: list[int] = field(default_factory=list)
    num_published: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence."""
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        """Blocks in its block table."""
        return len(self.block_table)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, blocks={self.block_table}, "
            f"state={self.state})"
        )


# Sequence ids a process takes at once from the header's counter (under the seqs lock).
SEQ_ID_BATCH = 256
SLOT_BATCH_MAX = 64


def slot_batch(max_seqs: int, max_clients: int) -> int:
    """Slots a process reserves at once: 0 (no reserve) on small tables, so that every
    process's reserve together (at most twice this each) never holds more than half the table."""
    return min(SLOT_BATCH_MAX, max_seqs // (4 * max_clients))


class SeqTable:
    """The sequence-table section: slot claim/release, owner-only writes after.

    A process claims slots in batches under the seqs lock into its **reserve** (slots marked
    `reserved` with its client index, still EMPTY); a sequence then takes a reserved slot, and a
    freed one goes back to the reserve, without the lock. The C core owns the reserve
    (csrc/sequences.c: its refill and trim, `reserve_ready`, before each operation that claims
    or releases a slot); this table's `core`, the pool handle's, claims and releases through it.
    Recovery returns a dead process's reserve (csrc/recovery.c, `detach_chunk`).
    """

    def __init__(self, view: SegmentView, lock: int, client: int, core: Any):
        self.view = view
        self.seqs = view.seqs
        self.state = view.seqs["state"]
        self.reserved = view.seqs["reserved"]
        self.owner_client = view.seqs["owner_client"]
        self.num_tokens = view.seqs["num_tokens"]
        self.num_blocks = view.seqs["num_blocks"]
        self.table = view.seqs["table"]
        self.base = view.offsets["seqs"]
        self.size = view.seqs.dtype.itemsize
        self.head_size = view.seqs.dtype.fields["table"][1]
        self.max_blocks = view.layout.max_blocks_per_seq
        self.lock = lock
        self.client = client
        self.batch = slot_batch(view.layout.max_seqs, view.layout.max_clients)
        # The C core holding this process's reserve (the pool handle's).
        self.core = core
        # num_tokens (u8) of slot s is word `num_tokens_at8 + s * rec8` of a flat uint64 view.
        end = view.offsets["end"]
        self.u64 = memoryview(view.buf)[:end].cast("Q")
        assert self.size % 8 == 0 and self.base % 8 == 0
        self.rec8 = self.size // 8
        self.num_tokens_at8 = (self.base + view.seqs.dtype.fields["num_tokens"][1]) // 8

    @property
    def reserve(self) -> list[int]:
        """This process's reserved slots as the core holds them (a copy; claims pop the end)."""
        return list(self.core.reserve_state()[0])

    def save_head(self, t: Txn, slot: int) -> None:
        """Journal the slot's fixed fields."""
        t.journal.save(self.base + slot * self.size, self.head_size)

    def can_claim_locally(self) -> bool:
        """True when the next claim needs no seqs lock (a reserved slot and an id are at hand):
        a hint for planning locks."""
        if not self.batch:
            return False
        slots, next_id, end_id = self.core.reserve_state()
        return bool(slots) and next_id < end_id

    def can_release_locally(self, slot: int) -> bool:
        """True when releasing `slot` puts it back in this process's reserve (no seqs lock): a
        hint for planning locks (the core's reserve_release decides)."""
        return (
            len(self.core.reserve_state()[0]) < 2 * self.batch
            and self.reserved[slot] == 1
            and self.owner_client[slot] == self.client
        )

    def claim(
        self, t: Txn, request: bytes, pid: int, start: int, client: int, site: int = -1
    ) -> tuple[int, int]:
        """Take an empty slot for a new sequence created at `site` (-1: not recorded); return
        (slot, seq_id)."""
        got = None
        if self.batch:
            self._restore_on_rollback(t)
            got = self.core.reserve_claim()
        if got is None:
            # No reserve (a small table), or an empty one (the table had no slot for it when it
            # was refilled): the lowest empty slot under the seqs lock, as the C core takes it.
            t.need(self.lock)
            slot = self._lowest_empty_slot()
            seq_id = self._take_ids(t, 1)
        else:
            slot, seq_id = got
        self.save_head(t, slot)
        rec = self.seqs[slot : slot + 1]
        rec["owner_pid"], rec["owner_client"], rec["owner_start"] = pid, client, start
        rec["request"], rec["seq_id"], rec["created_ns"] = request, seq_id, now_ns()
        rec["num_tokens"], rec["num_blocks"] = 0, 0
        rec["site"] = site + 1 if site >= 0 else 0
        self.state[slot] = SeqState.RUNNING
        crash_point("seqs.after_claim")
        return slot, seq_id

    def _restore_on_rollback(self, t: Txn) -> None:
        """Put the core's reserve back as it is now if `t` rolls back."""
        core, state = self.core, self.core.reserve_state()
        t.after_rollback.append(lambda: core.reserve_restore(state))

    def _lowest_empty_slot(self) -> int:
        """The lowest EMPTY slot no process reserves (caller: seqs lock)."""
        free = np.flatnonzero((self.state == SeqState.EMPTY) & (self.reserved == 0))
        if not len(free):
            n = len(self.state)
            held = int(((self.state == SeqState.EMPTY) & (self.reserved == 1)).sum())
            raise PoolError(
                f"sequence table full: {n - held} live sequences and {held} empty slots reserved by attached processes (PoolConfig.max_seqs is {n}); free finished ones or create the pool with a larger max_seqs"
            )
        return int(free[0])

    def _take_ids(self, t: Txn, k: int) -> int:
        """Advance the header's sequence-id counter by k; return the first id (seqs lock)."""
        h = self.view.header
        t.journal.save(h.dtype.fields["next_seq_id"][1], 8)
        first = int(h["next_seq_id"][0]) + 1
        h["next_seq_id"] = first + k - 1
        return first

    def release(self, t: Txn, slot: int) -> None:
        """Give a slot back: to this process's reserve, or (seqs lock) to the table."""
        self.save_head(t, slot)
        kept = False
        if self.batch:
            self._restore_on_rollback(t)
            kept = self.core.reserve_release(slot)
        if not kept:
            t.need(self.lock)
            self.reserved[slot] = 0
        self.state[slot] = SeqState.EMPTY
        self.num_blocks[slot] = 0
        crash_point("seqs.after_release")

    def write_blocks(self, t: Txn, slot: int, start: int, ids: np.ndarray | list[int]) -> None:
        """Write table entries [start, start+len(ids)) and the block count."""
        end = start + len(ids)
        if end > self.max_blocks:
            raise PoolError(
                f"sequence needs {end} blocks but PoolConfig.max_blocks_per_seq is {self.max_blocks}"
            )
        self.save_head(t, slot)
        if len(ids):
            off = self.base + slot * self.size + self.head_size + 4 * start
            t.journal.save(off, 4 * len(ids))
            self.table[slot, start:end] = ids
        self.num_blocks[slot] = end
        crash_point("seqs.after_table")

    def set_blocks(self, t: Txn, slot: int, pos: int, block: int) -> None:
        """Replace one table entry (copy-on-write)."""
        off = self.base + slot * self.size + self.head_size + 4 * pos
        t.journal.save(off, 4)
        self.table[slot, pos] = block
