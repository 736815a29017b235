"""The pool's locks belong to the operation: no stray close, garbage collection or forked child
changes who holds them (allocator/locks.py, allocator/ofd.py)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from kvscope.allocator import KVPool
from tests import lockholder
from tests.forking import fork_child
from tests.forking import wait_child as _wait

CHILD_ALARM_S = 30


def _fork(fn: Callable[[], int]) -> int:
    return fork_child(fn, CHILD_ALARM_S)


def _lock_is_free(pool: KVPool, lock: int) -> bool:
    """True when another thread can take `lock` now (taken and dropped again)."""
    at = lockholder.mutex_at(pool, lock)
    free: list[bool] = []

    def probe() -> None:
        free.append(lockholder.try_lock(at))
        if free[0]:
            lockholder.unlock(at)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return free[0]


def _segment_fds(path: str) -> int:
    """How many descriptors of this process are open on the file at path."""
    ino = os.stat(path).st_ino
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.fstat(int(name)).st_ino == ino
        except OSError:
            pass
    return n


@pytest.mark.slow
def test_a_collected_old_handle_does_not_release_a_live_operations_locks(make_pool):
    # GIVEN a process with the events probe on that attached, closed, dropped and attached
    # again, the old handle left in a reference cycle (the program's: a pool lets go of its
    # mapping with its last reference), so its mapping waits for the collector
    pool = make_pool(32)
    held_r, held_w = os.pipe()
    seen_r, seen_w = os.pipe()

    def worker() -> int:
        os.environ["KVSCOPE_EVENTS"] = "1"
        gc.disable()
        old = KVPool.attach(pool.name)
        assert old.probe is not None
        old.close()
        cycle: list = [old]
        cycle.append(cycle)
        del old, cycle
        new = KVPool.attach(pool.name)
        before = _segment_fds(pool._mf.path)

        def collect_inside() -> int:
            # WHEN the garbage collector closes the old mapping's descriptor mid-operation
            gc.collect()
            closed = before - _segment_fds(pool._mf.path)
            os.write(held_w, bytes([closed]))
            os.read(seen_r, 1)
            return closed

        lockholder.hold(new, new.FREE)
        try:
            closed = collect_inside()
        finally:
            lockholder.let_go(new, new.FREE)
        seq = new.allocate("after", [1, 2, 3, 4, 5])
        new.free(seq)
        new.close()
        return 0 if closed >= 1 else 5

    pid = _fork(worker)
    closed = os.read(held_r, 1)[0]
    # THEN the operation still holds its lock (another process cannot take it), and nothing
    # mistakes the live process for a dead one
    free_now = _lock_is_free(pool, pool.FREE)
    os.write(seen_w, b"1")
    assert _wait(pid) == 0
    assert closed >= 1, "the collector closed no descriptor: the scenario did not happen"
    assert not free_now
    assert pool.check() == []
    assert [f for f in pool.findings() if f.kind == "lock_dead_holder"] == []


def test_closing_one_handle_leaves_another_handles_lock_held(make_pool):
    # GIVEN two handles on one pool in this process, one inside an operation (on a lock that
    # closing does not take: handles of one process share their locks' thread locks)
    pool = make_pool(32)
    other = KVPool.attach(pool.name)
    sites = pool.locks.index("sites")

    def close_other() -> bool:
        # WHEN the other handle closes meanwhile
        other.close()
        return _lock_is_free(pool, sites)

    # THEN the operation's lock is still held
    lockholder.hold(pool, sites)
    try:
        assert close_other() is False
    finally:
        lockholder.let_go(pool, sites)
    assert _lock_is_free(pool, sites)
    assert pool.check() == []


@pytest.mark.slow
def test_a_forked_child_does_not_keep_its_dead_parents_lock(make_pool):
    # GIVEN a process attached to the pool that forks a long-lived child, then takes a lock
    pool = make_pool(32)
    child_r, child_w = os.pipe()
    held_r, held_w = os.pipe()
    ready_r, ready_w = os.pipe()

    def parent() -> int:
        p = KVPool.attach(pool.name)
        kid = os.fork()
        if kid == 0:
            # The child keeps every inherited descriptor and mapping until told to go; it
            # says when it runs (its re-open runs as it first runs, after the fork).
            os.write(ready_w, b"1")
            os.read(child_r, 1)
            os._exit(0)
        os.read(ready_r, 1)
        os.write(held_w, kid.to_bytes(4, "little"))
        lockholder.hold(p, p.FREE)
        os.write(held_w, b"1")
        time.sleep(CHILD_ALARM_S)
        return 0

    pid = _fork(parent)
    kid = int.from_bytes(os.read(held_r, 4), "little")
    os.read(held_r, 1)
    assert not _lock_is_free(pool, pool.FREE)
    # WHEN the parent is killed while holding it (the child still runs)
    os.kill(pid, signal.SIGKILL)
    _wait(pid)
    try:
        # THEN the lock is free at once, and the next taker recovers from the dead holder
        assert _lock_is_free(pool, pool.FREE)
        seq = pool.allocate("after", [1, 2, 3, 4, 5])
        pool.free(seq)
        assert [f.kind for f in pool.findings()] == ["lock_dead_holder"]
    finally:
        os.write(child_w, b"1")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{kid}"):
            time.sleep(0.01)
