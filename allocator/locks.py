"""Pool locks: a thread lock plus an fcntl byte-range lock on the segment file, per lock record.

The kernel drops a dead process's fcntl locks, so a lock is never stuck; the lock record still
names the dead holder, which tells the next taker to run recovery before it proceeds. Each
record also carries a sequence counter, odd while held: together these are the seqlock that
lock-free readers check.
"""

from __future__ import annotations

import errno
import fcntl
import struct
import threading
import time
from array import array
from collections.abc import Callable

from kvscope.allocator.errors import LockDeadlock
from kvscope.allocator.layout import LOCK_DTYPE, SegmentView, lock_names
from kvscope.allocator.segment import MappedFile

_F = LOCK_DTYPE.fields
_SEQ, _HOLDER, _ACQUIRES = _F["seq"][1], _F["holder_pid"][1], _F["num_acquires"][1]
_ACQUIRED, _HOLD = _F["acquired_ns"][1], _F["hold_ns"][1]
# holder_pid, holder_client, holder_start, holder_tid, acquired_ns: one contiguous store.
_HOLDER_REC = struct.Struct("<iiQQQ")
assert _F["acquired_ns"][1] == _HOLDER + _HOLDER_REC.size - 8
assert _F["max_hold_ns"][1] == _HOLD + 8
_U8 = struct.Struct("<Q")
_I4 = struct.Struct("<i")
_U8X2 = struct.Struct("<QQ")


# Bits of a handle's hooks word (KVPool._hooks): which probe hooks are set. The C core
# (allocator/native.py) runs only while the word is 0.
HOOK_PROBE, HOOK_SITE, HOOK_LOCKS = 1, 2, 4


def mark_hook(word: array, bit: int, on: bool) -> None:
    """Set or clear one bit of a hooks word."""
    word[0] = word[0] | bit if on else word[0] & ~bit


class DeadHolder(Exception):
    """A lock was taken whose record still names a holder that died holding it."""

    def __init__(self, lock: int, pid: int):
        super().__init__(f"lock {lock} was held by dead pid {pid}")
        self.lock, self.pid = lock, pid


class LockTable:
    """The pool's lock records and this process's handles on them."""

    def __init__(
        self,
        mf: MappedFile,
        view: SegmentView,
        pid: int,
        start: int,
        client: int,
        hooks: array | None = None,
    ):
        self.hooks = hooks if hooks is not None else array("q", [0])
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
        # The lock record's hot fields are read and written with struct on the mapping (numpy
        # scalar access costs several times more); the readers see the same bytes.
        self.mv = memoryview(mf.mm)
        if not hasattr(mf, "tlocks"):
            # One thread lock per pool lock per process: fcntl locks do not exclude threads.
            mf.tlocks = [threading.Lock() for _ in self.names]  # type: ignore[attr-defined]
        self.tlocks: list[threading.Lock] = mf.tlocks  # type: ignore[attr-defined]
        self.pid, self.start, self.client = pid, start, client
        # Probe hooks (lockdep, watchdog): None when off, so the cost is one attribute check.
        # on_release(i) also follows a failed acquisition announced by on_acquire(i).
        self.on_acquire = None
        self.on_release: Callable[[int], None] | None = None

    @property
    def on_acquire(self) -> Callable[[int], None] | None:
        """Probe hook called before each acquisition (lockdep, the watchdog), or None."""
        return self._on_acquire

    @on_acquire.setter
    def on_acquire(self, value: Callable[[int], None] | None) -> None:
        self._on_acquire = value
        mark_hook(self.hooks, HOOK_LOCKS, value is not None)

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
        mv = self.mv
        rec = self.base + i * LOCK_DTYPE.itemsize
        dead = _I4.unpack_from(mv, rec + _HOLDER)[0]
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
        self._mark_held(i, threading.get_native_id(), t0, time.perf_counter_ns(), contended)

    def _mark_held(self, i: int, tid: int, t0: int, t1: int, contended: bool) -> None:
        """Record lock i as ours (taken at t1 after waiting since t0 when contended)."""
        mv, rec = self.mv, self.base + i * LOCK_DTYPE.itemsize
        # Holder first, then make the counter odd: a death in between leaves a named dead holder.
        _HOLDER_REC.pack_into(mv, rec + _HOLDER, self.pid, self.client, self.start, tid, t1)
        seq = _U8.unpack_from(mv, rec + _SEQ)[0]
        _U8.pack_into(mv, rec + _SEQ, seq + (1 if seq % 2 == 0 else 2))
        _U8.pack_into(mv, rec + _ACQUIRES, _U8.unpack_from(mv, rec + _ACQUIRES)[0] + 1)
        if contended:
            # A run's one wait counts for each of its locks.
            self.num_contended[i] += 1
            self.wait_ns[i] += t1 - t0

    def acquire_run(self, run: list[int]) -> bool:
        """Take consecutive locks run[0]..run[-1] with one fcntl call over their bytes (one wait
        for all of them when another process holds some); False (nothing taken) when a lock
        probe watches each acquisition: the caller then takes them one by one with `acquire`."""
        if self.on_acquire is not None:
            return False
        tl = self.tlocks
        t0 = time.perf_counter_ns()
        for i in run:
            tl[i].acquire()
        first = self.base + run[0] * LOCK_DTYPE.itemsize
        length = (run[-1] - run[0]) * LOCK_DTYPE.itemsize + 1
        contended = False
        try:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, first)
            except (BlockingIOError, PermissionError):
                contended = True
                fcntl.lockf(self.fd, fcntl.LOCK_EX, length, first)
        except OSError as e:
            for i in reversed(run):
                tl[i].release()
            if e.errno == errno.EDEADLK:
                raise LockDeadlock(
                    f"taking pool locks {self.names[run[0]]!r}..{self.names[run[-1]]!r} would deadlock with another process "
                    "(the kernel reported EDEADLK): two processes take pool locks in opposite orders"
                ) from None
            raise
        except BaseException:
            for i in reversed(run):
                tl[i].release()
            raise
        mv = self.mv
        for i in run:
            dead = _I4.unpack_from(mv, self.base + i * LOCK_DTYPE.itemsize + _HOLDER)[0]
            if dead:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, length, first)
                for j in reversed(run):
                    tl[j].release()
                raise DeadHolder(i, dead)
        t1 = time.perf_counter_ns()
        tid = threading.get_native_id()
        for i in run:
            self._mark_held(i, tid, t0, t1, contended)
        return True

    def release_run(self, run: list[int]) -> None:
        """Release consecutive held locks, last first, with one fcntl call over their bytes."""
        if len(run) == 1 or self.on_release is not None:
            for i in reversed(run):
                self.release(i)
            return
        mv = self.mv
        now = time.perf_counter_ns()
        for i in reversed(run):
            rec = self.base + i * LOCK_DTYPE.itemsize
            held = now - _U8.unpack_from(mv, rec + _ACQUIRED)[0]
            hold, longest = _U8X2.unpack_from(mv, rec + _HOLD)
            _U8X2.pack_into(mv, rec + _HOLD, hold + held, max(longest, held))
            _U8.pack_into(mv, rec + _SEQ, _U8.unpack_from(mv, rec + _SEQ)[0] + 1)
            _I4.pack_into(mv, rec + _HOLDER, 0)
        first = self.base + run[0] * LOCK_DTYPE.itemsize
        length = (run[-1] - run[0]) * LOCK_DTYPE.itemsize + 1
        fcntl.lockf(self.fd, fcntl.LOCK_UN, length, first)
        for i in reversed(run):
            self.tlocks[i].release()

    def release(self, i: int) -> None:
        """Release lock i (the journal must already be committed)."""
        mv = self.mv
        rec = self.base + i * LOCK_DTYPE.itemsize
        held = time.perf_counter_ns() - _U8.unpack_from(mv, rec + _ACQUIRED)[0]
        hold, longest = _U8X2.unpack_from(mv, rec + _HOLD)
        _U8X2.pack_into(mv, rec + _HOLD, hold + held, max(longest, held))
        # Counter even first, then clear the holder (see acquire).
        _U8.pack_into(mv, rec + _SEQ, _U8.unpack_from(mv, rec + _SEQ)[0] + 1)
        _I4.pack_into(mv, rec + _HOLDER, 0)
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, rec)
        self.tlocks[i].release()
        if self.on_release is not None:
            self.on_release(i)

    def clear_dead(self, i: int) -> None:
        """Forget a dead holder of lock i (called during recovery while holding it)."""
        self.holder_pid[i] = 0
        if self.seq[i] % 2:
            self.seq[i] += 1
