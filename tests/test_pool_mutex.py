"""The pool locks' mutexes, as the C core makes them (init_lock_mutexes, for header.py):
process-shared, robust, error-checking."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import threading

import pytest

from kvscope.allocator import _native
from kvscope.allocator.records import LOCK_MUTEX_BYTES
from tests.lockholder import lock, try_lock, unlock


@pytest.fixture
def shared_mutex():
    """A lock record's mutex in a shared anonymous mapping (inherited by forked children), made
    by the core, and its address."""
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    _native.init_lock_mutexes(mm, 1)
    buf = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(buf)
    yield addr
    del buf
    mm.close()


def _in_thread(fn):
    """fn() run in another thread: its result, or the exception it raised, raised here."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def test_the_record_keeps_room_for_the_mutex():
    libc_size = 40 if os.uname().machine == "x86_64" else 48
    assert LOCK_MUTEX_BYTES >= libc_size


def test_a_held_mutex_excludes_another_thread_and_refuses_its_owner_twice(shared_mutex):
    assert try_lock(shared_mutex)
    assert _in_thread(lambda: try_lock(shared_mutex)) is False
    with pytest.raises(OSError) as again:
        try_lock(shared_mutex)
    assert again.value.errno == errno.EDEADLK
    unlock(shared_mutex)
    assert _in_thread(lambda: try_lock(shared_mutex)) is True


def test_only_the_holder_may_release(shared_mutex):
    assert try_lock(shared_mutex)
    with pytest.raises(OSError) as stranger:
        _in_thread(lambda: unlock(shared_mutex))
    assert stranger.value.errno == errno.EPERM
    unlock(shared_mutex)


def test_a_mutex_whose_holder_was_killed_is_taken_again(shared_mutex):
    # GIVEN a child process that took the mutex and was killed holding it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        os.close(r)
        lock(shared_mutex)
        os.write(w, b"1")
        signal.pause()
        os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"1"
    assert try_lock(shared_mutex) is False
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    # THEN the next taker gets it (made consistent), and it works as a lock afterwards
    assert try_lock(shared_mutex) is True
    unlock(shared_mutex)
    lock(shared_mutex)
    assert _in_thread(lambda: try_lock(shared_mutex)) is False
    unlock(shared_mutex)
