"""Pool locks: a thread lock plus an fcntl byte-range lock on the segment file, per lock record.

The kernel drops a dead process's fcntl locks, so a lock is never stuck; the lock record still
names the dead holder, which tells the next taker to run recovery before it proceeds. Each
record also carries a sequence counter, odd while held: together these are the seqlock that
lock-free readers check.
"""

from __future__ import annotations

import errno
import fcntl
import threading
import time
from collections.abc import Callable

from kvscope.allocator.errors import LockDeadlock
from kvscope.allocator.layout import LOCK_DTYPE, SegmentView, lock_names
from kvscope.allocator.segment import MappedFile


class DeadHolder(Exception):
    """A lock was taken whose record still names a holder that died holding it."""

    def __init__(self, lock: int, pid: int):
        super().__init__(f"lock {lock} was held by dead pid {pid}")
        self.lock, self.pid = lock, pid


class LockTable:
    """The pool's lock records and this process's handles on them."""

    def __init__(self, mf: MappedFile, view: SegmentView, pid: int, start: int, client: int):
        self.fd = mf.fd
        self.names = lock_names(view.layout.num_shards)
        self.base = view.offsets["locks"]
        locks = view.locks
        self.seq = locks["seq"]
        self.holder_pid = locks["holder_pid"]
        self.holder_client = locks["holder_client"]
        self.holder_start = locks["holder_start"]
        self.holder_tid = locks["holder_tid"]
        self.acquired_ns = locks["acquired_ns"]
        self.num_acquires = locks["num_acquires"]
        self.num_contended = locks["num_contended"]
        self.wait_ns = locks["wait_ns"]
        self.hold_ns = locks["hold_ns"]
        self.max_hold_ns = locks["max_hold_ns"]
        if not hasattr(mf, "tlocks"):
            # One thread lock per pool lock per process: fcntl locks do not exclude threads.
            mf.tlocks = [threading.Lock() for _ in self.names]  # type: ignore[attr-defined]
        self.tlocks: list[threading.Lock] = mf.tlocks  # type: ignore[attr-defined]
        self.pid, self.start, self.client = pid, start, client
        # Probe hooks (lockdep, watchdog): None when off, so the cost is one attribute check.
        # on_release(i) also follows a failed acquisition announced by on_acquire(i).
        self.on_acquire: Callable[[int], None] | None = None
        self.on_release: Callable[[int], None] | None = None

    def index(self, name: str) -> int:
        """Index of a lock by name."""
        return self.names.index(name)

    def acquire(
        self,
        i: int,
        *,
        recovering: bool = False,
        on_dead: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """Take lock i; raise DeadHolder (lock released again) if a dead process left it held."""
        if self.on_acquire is not None:
            self.on_acquire(i)
        t0 = time.perf_counter_ns()
        self.tlocks[i].acquire()
        off = self.base + i * LOCK_DTYPE.itemsize
        contended = False
        try:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, off)
            except (BlockingIOError, PermissionError):
                contended = True
                fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, off)
        except OSError as e:
            self.tlocks[i].release()
            if self.on_release is not None:
                self.on_release(i)
            if e.errno == errno.EDEADLK:
                raise LockDeadlock(
                    f"taking pool lock {self.names[i]!r} would deadlock with another process "
                    "(the kernel reported EDEADLK): two processes take pool locks in opposite orders"
                ) from None
            raise
        dead = int(self.holder_pid[i])
        if dead:
            if not recovering:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, off)
                self.tlocks[i].release()
                if self.on_release is not None:
                    self.on_release(i)
                raise DeadHolder(i, dead)
            if on_dead is not None:
                on_dead(i, dead, int(self.holder_client[i]))
            self.clear_dead(i)
        t1 = time.perf_counter_ns()
        # Holder first, then make the counter odd: a death in between leaves a named dead holder.
        self.holder_pid[i] = self.pid
        self.holder_client[i] = self.client
        self.holder_start[i] = self.start
        self.holder_tid[i] = threading.get_native_id()
        self.acquired_ns[i] = t1
        self.seq[i] += 1 if self.seq[i] % 2 == 0 else 2
        self.num_acquires[i] += 1
        if contended:
            self.num_contended[i] += 1
            self.wait_ns[i] += t1 - t0

    def release(self, i: int) -> None:
        """Release lock i (the journal must already be committed)."""
        held = time.perf_counter_ns() - int(self.acquired_ns[i])
        self.hold_ns[i] += held
        if held > self.max_hold_ns[i]:
            self.max_hold_ns[i] = held
        # Counter even first, then clear the holder (see acquire).
        self.seq[i] += 1
        self.holder_pid[i] = 0
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, self.base + i * LOCK_DTYPE.itemsize)
        self.tlocks[i].release()
        if self.on_release is not None:
            self.on_release(i)

    def clear_dead(self, i: int) -> None:
        """Forget a dead holder of lock i (called during recovery while holding it)."""
        self.holder_pid[i] = 0
        if self.seq[i] % 2:
            self.seq[i] += 1
