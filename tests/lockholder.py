"""A pool lock held by a test: its mutex taken through glibc (ctypes) and its record written as
the C core's lock_get and lock_drop write it (csrc/locks.c), so that a test can be the holder
that the core, lockdep and the watchdog meet (this thread, another process, a dead one). Tests
only: the allocator takes its locks in its C core, the pool's only writer."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from typing import Any

from kvscope.allocator.layout import LOCK_DTYPE

_libc = ctypes.CDLL(None, use_errno=True)
for _name in (
    "pthread_mutex_lock",
    "pthread_mutex_trylock",
    "pthread_mutex_unlock",
    "pthread_mutex_consistent",
):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p]


def mutex_at(pool: Any, i: int) -> int:
    """The address of pool lock i's mutex in this process's mapping."""
    return pool.view.locks[i : i + 1].__array_interface__["data"][0] + LOCK_DTYPE.fields["mutex"][1]


def _taken(rc: int, addr: int, what: str) -> bool:
    if rc == errno.EOWNERDEAD:
        # Its holder died: ours now (the record still names that holder).
        rc = _libc.pthread_mutex_consistent(addr)
    if rc == errno.EBUSY:
        return False
    if rc:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")
    return True


def try_lock(addr: int) -> bool:
    """Take the mutex at addr if it is free (or its holder died); False when another holds it."""
    return _taken(_libc.pthread_mutex_trylock(addr), addr, "pthread_mutex_trylock")


def lock(addr: int) -> None:
    """Take the mutex at addr, waiting for it (ctypes lets the GIL go meanwhile)."""
    _taken(_libc.pthread_mutex_lock(addr), addr, "pthread_mutex_lock")


def unlock(addr: int) -> None:
    """Let go of the mutex at addr (held by this thread)."""
    rc = _libc.pthread_mutex_unlock(addr)
    if rc:
        raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")


def hold(pool: Any, i: int) -> None:
    """Take pool lock i for this thread, waiting for it; its record names this thread as the
    core's would. A record that still names a dead holder is refused (RuntimeError, the lock let
    go): the core recovers it at its next operation."""
    at = mutex_at(pool, i)
    lock(at)
    rec = pool.view.locks[i : i + 1]
    if int(rec["holder_pid"][0]):
        unlock(at)
        raise RuntimeError(f"pool lock {i} is held by dead pid {int(rec['holder_pid'][0])}")
    # Holder first, then make the counter odd: a death in between leaves a named dead holder.
    rec["holder_pid"], rec["holder_client"] = pool.pid, pool.client
    rec["holder_start"], rec["holder_tid"] = pool.start, threading.get_native_id()
    rec["acquired_ns"] = time.perf_counter_ns()
    rec["seq"] += 1 if int(rec["seq"][0]) % 2 == 0 else 2
    rec["num_acquires"] += 1


def let_go(pool: Any, i: int) -> None:
    """Let go of pool lock i, held by this thread (`hold`)."""
    rec = pool.view.locks[i : i + 1]
    held = time.perf_counter_ns() - int(rec["acquired_ns"][0])
    rec["hold_ns"] += held
    rec["max_hold_ns"] = max(int(rec["max_hold_ns"][0]), held)
    # Counter even first, then clear the holder.
    rec["seq"] += 1
    rec["holder_pid"] = 0
    unlock(mutex_at(pool, i))
