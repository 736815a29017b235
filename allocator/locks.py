"""Pool locks: the process-shared robust mutex in each lock record, and what readers know of them.

The C core takes them, for its operations and for every write Python asks of it (lockdep's
graph, a finding, a site: csrc/locks.c, csrc/probes.c), and made them when the segment was
created (header.py: `init_lock_mutexes`). When a holder dies the kernel marks its mutex, so a
lock is never stuck; the lock record still names the dead holder, which tells the next taker to
run recovery before it proceeds (csrc/recovery.c). Each record also carries a sequence counter,
odd while held: together these are the seqlock that lock-free readers check. `LockTable` is
this process's table of them, read only: their names and records for the readers and probes
(the watchdog, otel_locks, lockdep's held pool locks). The core publishes the locks a process
waits for in its client record (waits.py).
"""

from __future__ import annotations

from kvscope.allocator import ofd
from kvscope.allocator.layout import SegmentView, lock_names
from kvscope.allocator.segment import MappedFile

# Locks lockdep does not order (leaves, taken alone), and the lock class of a pool lock name
# (the index shards collapse to "index"): the C core and probes/lockdep.py both need them.
UNTRACED = frozenset({"sites", "findings"})


def lock_class(name: str) -> str:
    """The lock class of a pool lock name: the index shards collapse to "index"."""
    return "index" if name.startswith("index.") else name


class LockTable:
    """The pool's lock records as this process reads them."""

    def __init__(self, mf: MappedFile, view: SegmentView, pid: int, start: int, client: int):
        self.names = lock_names(view.layout.num_shards)
        locks = view.locks
        self.seq = locks["seq"]
        self.holder_pid = locks["holder_pid"]
        self.holder_start = locks["holder_start"]
        self.holder_tid = locks["holder_tid"]
        self.acquired_ns = locks["acquired_ns"]
        self.pid, self.start, self.client = pid, start, client
        # (the mapping re-opened in a forked child, so that its OFD lock is its own: ofd.py)
        ofd.track(mf)

    def index(self, name: str) -> int:
        """Index of a lock by name."""
        return self.names.index(name)
