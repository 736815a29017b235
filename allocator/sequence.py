"""Sequence: one request's view of its blocks (the C core builds and updates it), and the slot
reserve's batch sizes the core is configured with.

A process claims sequence-table slots in batches under the seqs lock into its **reserve**
(slots marked `reserved` with its client index, still EMPTY); a sequence then takes a reserved
slot, and a freed one goes back to the reserve, without the lock. The core holds the reserve
(csrc/sequences.c: its refill and trim, `reserve_run`, before each operation that claims or
releases a slot, in the core's call of it); recovery returns a dead process's reserve (csrc/recovery.c, `detach_chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.allocator.records import SEQ_ID_BATCH  # noqa: F401 - (replay.py reads it here)


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


SLOT_BATCH_MAX = 64


def slot_batch(max_seqs: int, max_clients: int) -> int:
    """Slots a process reserves at once: 0 (no reserve) on small tables, so that every
    process's reserve together (at most twice this each) never holds more than half the table."""
    return min(SLOT_BATCH_MAX, max_seqs // (4 * max_clients))
