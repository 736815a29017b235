"""A client's undo journal written by hand, as the C core writes it (csrc/journal.c), for tests
that leave a process dead or stopped inside an operation."""

from __future__ import annotations

from kvscope.allocator import KVPool


def journal_save(pool: KVPool, offset: int, length: int) -> None:
    """Save `length` bytes at segment `offset` in the handle's undo journal, entry count last,
    as the core does before it writes them."""
    cl, c = pool.view.clients, pool.client
    n, used = int(cl["journal_count"][c]), int(cl["journal_used"][c])
    cl["journal"][c][n] = (offset, length, used, 0)
    cl["journal_data"][c][used : used + length] = pool.view.raw[offset : offset + length]
    cl["journal_used"][c] = used + length
    cl["journal_count"][c] = n + 1
