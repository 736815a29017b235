"""Pool locks: a thread lock plus the process-shared robust mutex in each lock record (mutex.py).

The C core takes them for its operations (csrc/locks.c); `LockTable` is this process's table of
them: their names and records for the readers and probes, and `acquire`/`release` for the one
lock Python takes itself, the findings lock lockdep's graph is written under
(probes/lockgraph.py). A free lock is taken without a system call. When a holder dies the kernel
marks its mutex, so a lock is never stuck; the lock record still names the dead holder, which
tells the next taker to run recovery before it proceeds. Each record also carries a sequence
counter, odd while held: together these are the seqlock that lock-free readers check. A process
publishes the locks it waits for (waits.py), so that a lock-order inversion between processes
raises LockDeadlock instead of hanging.
"""

from __future__ import annotations

import struct
import threading
import time

from kvscope.allocator import mutex, ofd
from kvscope.allocator.errors import LockDeadlock
from kvscope.allocator.layout import CLIENT_DTYPE, LOCK_DTYPE, SegmentView, lock_names
from kvscope.allocator.segment import MappedFile
from kvscope.allocator.waits import WAIT_AT, find_cycle, wait_word

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
# A lock taken out of order is waited for in slices (growing to the max), looking for a wait
# cycle between slices.
WAIT_SLICE_S, WAIT_SLICE_MAX_S = 0.001, 0.05


# Locks lockdep does not order (leaves, taken alone), and the lock class of a pool lock name
# (the index shards collapse to "index"): the C core and probes/lockdep.py both need them.
UNTRACED = frozenset({"sites", "findings"})


def lock_class(name: str) -> str:
    """The lock class of a pool lock name: the index shards collapse to "index"."""
    return "index" if name.startswith("index.") else name


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
    ):
        self.fd = mf.fd
        # Lock i's mutex is at mutex_at + i * stride in this process's mapping.
        self.stride = LOCK_DTYPE.itemsize
        self.mutex_at = view.locks.__array_interface__["data"][0] + _F["mutex"][1]
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
            # One thread lock per pool lock per process: a thread waits for another thread of
            # its process here, not on the mutex (whose waits the C core publishes).
            mf.tlocks = [threading.Lock() for _ in self.names]  # type: ignore[attr-defined]
        self.tlocks: list[threading.Lock] = mf.tlocks  # type: ignore[attr-defined]
        self.pid, self.start, self.client = pid, start, client
        self.view = view
        # Where this process publishes the locks it waits for (waits.py).
        self.wait_at = view.offsets["clients"] + client * CLIENT_DTYPE.itemsize + WAIT_AT
        ofd.track(mf)

    def index(self, name: str) -> int:
        """Index of a lock by name."""
        return self.names.index(name)

    def acquire(self, i: int) -> None:
        """Take lock i; raise DeadHolder (lock released again) if a dead process left it held
        (the core's next operation under it recovers it: csrc/recovery.c)."""
        t0 = time.perf_counter_ns()
        self.tlocks[i].acquire()
        try:
            contended = self._take(i, i)
        except BaseException:
            self.tlocks[i].release()
            raise
        mv = self.mv
        rec = self.base + i * LOCK_DTYPE.itemsize
        dead = _I4.unpack_from(mv, rec + _HOLDER)[0]
        if dead:
            mutex.unlock(self.mutex_at + i * self.stride)
            self.tlocks[i].release()
            raise DeadHolder(i, dead)
        self._mark_held(i, threading.get_native_id(), t0, time.perf_counter_ns(), contended)

    def _take(self, first: int, last: int) -> bool:
        """Take the mutexes of locks first..last in order; True when another process held one
        of them and this thread waited."""
        at, stride = self.mutex_at, self.stride
        i = first
        while i <= last and mutex.try_lock(at + i * stride):
            i += 1
        if i > last:
            return False
        mv = self.mv
        _U8.pack_into(mv, self.wait_at, wait_word(first, last))
        taken = [i]  # the first lock of the run not yet taken (updated as the wait goes on)
        try:
            tid = threading.get_native_id()
            if not self._holds_above(first, tid):
                # In the documented order: this wait cannot close a cycle.
                while taken[0] <= last:
                    mutex.lock(at + taken[0] * stride)
                    taken[0] += 1
            else:
                self._wait_watching(first, last, taken, tid)
        except BaseException:
            for j in reversed(range(first, taken[0])):
                mutex.unlock(at + j * stride)
            raise
        finally:
            _U8.pack_into(mv, self.wait_at, 0)
        return True

    def _holds_above(self, i: int, tid: int) -> bool:
        """True when this thread holds a pool lock ordered after lock i."""
        pids, tids = self.holder_pid[i + 1 :], self.holder_tid[i + 1 :]
        return bool(((pids == self.pid) & (tids == tid)).any())

    def _wait_watching(self, first: int, last: int, taken: list[int], tid: int) -> None:
        """Wait in slices for locks taken out of order (taken[0]..last, advancing taken[0] as
        each is taken), raising LockDeadlock on a wait cycle."""
        at, stride = self.mutex_at, self.stride
        pause = WAIT_SLICE_S
        while True:
            while taken[0] <= last and mutex.try_lock(at + taken[0] * stride):
                taken[0] += 1
            if taken[0] > last:
                return
            cycle = find_cycle(self.view, self.pid, tid, range(first, last + 1))
            if cycle is not None:
                what = (
                    f"pool lock {self.names[first]!r}"
                    if first == last
                    else f"pool locks {self.names[first]!r}..{self.names[last]!r}"
                )
                raise LockDeadlock(
                    f"taking {what} would deadlock with another process ({'; '.join(cycle)}, "
                    "which this thread holds): two processes take pool locks in opposite orders"
                )
            time.sleep(pause)
            pause = min(2 * pause, WAIT_SLICE_MAX_S)

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
        mutex.unlock(self.mutex_at + i * self.stride)
        self.tlocks[i].release()
