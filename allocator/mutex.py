"""The pool locks' mutexes: a process-shared robust pthread mutex in each lock record.

Taking a free lock is one atomic instruction in the taker's own process, no system call; a
taker that finds it held sleeps on its futex. When a holder dies, the kernel marks the mutex
(the thread's robust list) and the next taker gets it with `EOWNERDEAD`; it is made consistent
at once, and the lock record, which still names the dead holder, tells the taker to run
recovery (csrc/recovery.c). The C core (csrc/locks.c) calls the same glibc functions on the
same bytes; this module is Python's way to them (ctypes: header.py creates them, and LockTable
takes the findings lock through it for lockdep's graph).
The mutexes are error-checking: a thread that takes a lock it holds, or releases one it does
not hold, gets an error instead of a deadlock or a broken lock.
"""

from __future__ import annotations

import ctypes
import errno
import os

_libc = ctypes.CDLL(None, use_errno=True)
for _name in (
    "pthread_mutex_lock",
    "pthread_mutex_trylock",
    "pthread_mutex_unlock",
    "pthread_mutex_consistent",
    "pthread_mutexattr_init",
    "pthread_mutexattr_destroy",
):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p]
_libc.pthread_mutex_init.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
for _name in ("pthread_mutexattr_settype", "pthread_mutexattr_setpshared"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p, ctypes.c_int]
_libc.pthread_mutexattr_setrobust.argtypes = [ctypes.c_void_p, ctypes.c_int]

# <pthread.h> (glibc, Linux)
PTHREAD_MUTEX_ERRORCHECK = 2
PTHREAD_PROCESS_SHARED = 1
PTHREAD_MUTEX_ROBUST = 1

_lock = _libc.pthread_mutex_lock
_trylock = _libc.pthread_mutex_trylock
_unlock = _libc.pthread_mutex_unlock


def _check(rc: int, what: str) -> None:
    if rc:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")


def init(addr: int) -> None:
    """Make the bytes at addr a free process-shared, robust, error-checking mutex."""
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes with glibc
    _check(_libc.pthread_mutexattr_init(attr), "pthread_mutexattr_init")
    try:
        _check(
            _libc.pthread_mutexattr_settype(attr, PTHREAD_MUTEX_ERRORCHECK),
            "pthread_mutexattr_settype",
        )
        _check(
            _libc.pthread_mutexattr_setpshared(attr, PTHREAD_PROCESS_SHARED),
            "pthread_mutexattr_setpshared",
        )
        _check(
            _libc.pthread_mutexattr_setrobust(attr, PTHREAD_MUTEX_ROBUST),
            "pthread_mutexattr_setrobust",
        )
        _check(_libc.pthread_mutex_init(addr, attr), "pthread_mutex_init")
    finally:
        _libc.pthread_mutexattr_destroy(attr)


def _taken(rc: int, addr: int, what: str) -> bool:
    if rc == 0:
        return True
    if rc == errno.EOWNERDEAD:
        # Its holder died: ours now; the lock record still names that holder (locks.py).
        _check(_libc.pthread_mutex_consistent(addr), "pthread_mutex_consistent")
        return True
    if rc == errno.EBUSY:
        return False
    raise OSError(rc, f"{what}: {os.strerror(rc)}")


def try_lock(addr: int) -> bool:
    """Take the mutex at addr if it is free (or its holder died); False when another holds it."""
    return _taken(_trylock(addr), addr, "pthread_mutex_trylock")


def lock(addr: int) -> None:
    """Take the mutex at addr, waiting for it (the GIL is released meanwhile)."""
    _taken(_lock(addr), addr, "pthread_mutex_lock")


def unlock(addr: int) -> None:
    """Release the mutex at addr (held by this thread)."""
    _check(_unlock(addr), "pthread_mutex_unlock")
