"""The one exception family users see from the pool."""

from __future__ import annotations


class PoolError(Exception):
    """Something a user can cause: a wrong name, a bad file, a full pool. The message says what to do."""

    exit_code = 2


class PoolExhausted(PoolError):
    """No block can be found for a request, even after evicting everything evictable."""

    exit_code = 1

    def __init__(self, needed: int, free: int, cached: int, held: int, holders: dict[str, int]):
        self.needed, self.free, self.cached, self.held, self.holders = (
            needed,
            free,
            cached,
            held,
            holders,
        )
        top = ", ".join(f"{r}={n}" for r, n in sorted(holders.items(), key=lambda x: -x[1])[:5])
        super().__init__(
            f"pool exhausted: {needed} blocks needed, {free} free, {cached} cached, {held} held"
            + (f" (by {top})" if top else "")
            + "; free finished requests, mark idle ones waiting, or create a larger pool"
        )


class LockDeadlock(PoolError):
    """Waiting for a pool lock would deadlock: a wait cycle between processes (allocator/waits.py)."""

    exit_code = 1
