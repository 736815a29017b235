"""The one exception family users see from the pool."""

from __future__ import annotations


class PoolError(Exception):
    """Something a user can cause: a wrong name, a bad file, a full pool. The message says what to do."""

    exit_code = 2


class FormatVersionError(PoolError):
    """A segment written by a kvscope of another format version: none of it is read (its
    layout is not this build's). `version` is the file's."""

    def __init__(self, message: str, version: int):
        self.version = version
        super().__init__(message)


class PoolExhausted(PoolError):
    """No block can be found for a request, even after evicting everything evictable."""

    exit_code = 1

    def __init__(
        self,
        needed: int,
        free: int,
        cached: int,
        held: int,
        holders: dict[str, int],
        elsewhere: dict[int, int] | None = None,
        dead: dict[int, int] | None = None,
    ):
        self.needed, self.free, self.cached, self.held, self.holders = (
            needed,
            free,
            cached,
            held,
            holders,
        )
        # free blocks in other processes' local caches, by pid (this process cannot take them)
        self.elsewhere = elsewhere or {}
        # blocks that requests of dead processes hold, by pid (each block once): what
        # reclaim_dead() hands back
        self.dead = dead or {}
        biggest = sorted(holders.items(), key=lambda x: -x[1])
        top = ", ".join(f"{r}={n}" for r, n in biggest[:5])
        if len(biggest) > 5:
            # (their blocks are not summed: requests that share a prefix map the same blocks)
            more = len(biggest) - 5
            top += f" and {more} more request{'s' if more > 1 else ''}"
        lost = sum(self.dead.values())
        dead_pids = ", ".join(
            f"pid {p}: {n}" for p, n in sorted(self.dead.items(), key=lambda x: -x[1])[:5]
        )
        reclaim = (
            f"; {lost} of the held blocks belong to requests of processes that died ({dead_pids}):"
            " pool.reclaim_dead() (or `kvscope check NAME --repair`) hands them back"
            if lost
            else ""
        )
        away = sum(self.elsewhere.values())
        pids = ", ".join(
            f"pid {p}: {n}" for p, n in sorted(self.elsewhere.items(), key=lambda x: -x[1])[:5]
        )
        super().__init__(
            f"pool exhausted: {needed} block{'' if needed == 1 else 's'} needed, {free} free"
            + (f" ({away} of them in other processes' local caches, {pids})" if away else "")
            + f", {cached} cached, {held} held"
            + (f" (by {top})" if top else "")
            + reclaim
            + "; free finished requests, mark idle ones waiting, or create a larger pool"
            + (
                " (or a smaller local_cache_size: each process keeps up to twice it)"
                if away
                else ""
            )
        )


class HandleInherited(PoolError):
    """An operation on a pool handle another process opened: a forked child's copy of its
    parent's handle (the C core raises it, csrc/entry.c `unusable`; the child attaches a handle
    of its own). `name` is the pool's, `opener_pid` the process that opened the handle."""

    def __init__(self, name: str, opener_pid: int):
        self.name, self.opener_pid = name, opener_pid
        super().__init__(
            f"this handle on pool {name!r} was opened by pid {opener_pid}; "
            "in a forked child call KVPool.attach(name) instead"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        # (a multiprocessing worker's exception crosses to its parent pickled)
        return type(self), (self.name, self.opener_pid)


class JournalFull(PoolError):
    """An operation's writes outgrow the undo journal (it is rolled back, nothing changed).

    The C core raises it where even its smallest transaction does not fit (csrc/journal.c): a
    `fork` of a table longer than one transaction's journal holds. Anything else that outgrows
    the journal the core evicts or preempts ahead, or splits into smaller transactions.
    """


class LockDeadlock(PoolError):
    """Waiting for a pool lock would deadlock. Kept for code that catches it; nothing raises it
    now: only the C core takes the pool's locks, always in the one order (docs/FORMAT.md section
    7), so no wait between them closes a cycle."""

    exit_code = 1


class OplogError(ValueError):
    """An operation log that cannot be read as one (allocator/oplog.py): its one-line reason."""
