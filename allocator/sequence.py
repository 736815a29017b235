"""Sequence: one request's view of its blocks, and the shared sequence table that records it."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(eq=False)
class Sequence:
    """A live sequence of one pool, owned by the process that allocated it."""

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


class SeqTable:
    """The sequence-table section: slot claim/release under the seqs lock, owner-only writes after."""

    def __init__(self, view: SegmentView, lock: int):
        self.view = view
        self.seqs = view.seqs
        self.state = view.seqs["state"]
        self.num_tokens = view.seqs["num_tokens"]
        self.num_blocks = view.seqs["num_blocks"]
        self.table = view.seqs["table"]
        self.base = view.offsets["seqs"]
        self.size = view.seqs.dtype.itemsize
        self.head_size = view.seqs.dtype.fields["table"][1]
        self.max_blocks = view.layout.max_blocks_per_seq
        self.lock = lock
        self._hint = 0

    def save_head(self, t: Txn, slot: int) -> None:
        """Journal the slot's fixed fields."""
        t.journal.save(self.base + slot * self.size, self.head_size)

    def claim(self, t: Txn, request: bytes, pid: int, start: int, client: int) -> tuple[int, int]:
        """Take an empty slot for a new sequence; return (slot, seq_id)."""
        t.need(self.lock)
        n = len(self.state)
        empty = np.flatnonzero(self.state[self._hint :] == SeqState.EMPTY)
        if len(empty):
            slot = self._hint + int(empty[0])
        else:
            empty = np.flatnonzero(self.state[: self._hint] == SeqState.EMPTY)
            if not len(empty):
                raise PoolError(
                    f"sequence table full: {n} live sequences (PoolConfig.max_seqs); free finished ones or create the pool with a larger max_seqs"
                )
            slot = int(empty[0])
        self._hint = (slot + 1) % n
        h = self.view.header
        off = h.dtype.fields["next_seq_id"][1]
        t.journal.save(off, 8)
        seq_id = int(h["next_seq_id"][0]) + 1
        h["next_seq_id"] = seq_id
        self.save_head(t, slot)
        rec = self.seqs[slot : slot + 1]
        rec["owner_pid"], rec["owner_client"], rec["owner_start"] = pid, client, start
        rec["request"], rec["seq_id"], rec["created_ns"] = request, seq_id, now_ns()
        rec["num_tokens"], rec["num_blocks"] = 0, 0
        self.state[slot] = SeqState.RUNNING
        crash_point("seqs.after_claim")
        return slot, seq_id

    def release(self, t: Txn, slot: int) -> None:
        """Give a slot back."""
        t.need(self.lock)
        self.save_head(t, slot)
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
