"""Pool states that several test files build the same way, as an engine's bug leaves them."""

from __future__ import annotations

from typing import Any


def published_before_written(pool: Any) -> tuple[Any, Any, int]:
    """An engine that publishes a prompt before writing its K/V: "early" publishes its first
    block blank, "reader" hits it blank, then the publisher writes it (the late write).
    Returns (early, reader, the block)."""
    early = pool.allocate("early", list(range(9)))
    pool.mark_computed(early, 8)
    reader = pool.allocate("reader", list(range(8)) + [70])
    blk = early.block_table[0]
    assert reader.block_table[0] == blk
    pool.kv[:, :, blk] = 1.0  # (the publisher's late write)
    return early, reader, blk
