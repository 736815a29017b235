"""Open-file-description locks on the segment file, and keeping them out of forked children.

The client-registration lock (attach, detach: lifecycle.py) is a Linux OFD lock (`F_OFD_SETLK`,
`F_OFD_SETLKW`) on the first byte of the client table, not a POSIX record lock (`lockf`,
`F_SETLK`). A POSIX lock belongs to the process, and the kernel drops every one of them when the
process closes *any* descriptor of the file: a handle closed (or garbage-collected) in the
middle of another handle's attach would hand its lock to other processes. An OFD lock belongs to
one `open()` of the file (the open file description, shared by its `dup`s and by mappings made
from it) and is dropped when the last reference to it goes: when its process dies or closes
that one open, never at a stray close. (The pool's own locks are the robust mutexes in the lock
records: locks.py.)

A forked child inherits references to its parent's open file descriptions (its descriptors and
mappings): a parent killed while holding a lock would leave it held for as long as a child
lives. So the child re-opens every segment it has mapped, right after the fork, and maps the new
open over the same addresses (`_reopen_in_child`): its pages, numpy views and descriptor numbers
stay valid, and it no longer holds a reference to its parent's open. The re-open runs when the
child first runs after the fork: a parent killed before that (a child not yet scheduled on a
loaded machine) leaves its lock held until the child runs and re-opens, then it drops.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
import weakref
from typing import Any

# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
_FLOCK = struct.Struct("hhqqi4x")
assert _FLOCK.size == 32
_MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


def lock(fd: int, start: int, length: int, *, wait: bool) -> bool:
    """Lock bytes [start, start+length) for writing; False when another open holds part of
    them and `wait` is False."""
    arg = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, start: int, length: int) -> None:
    """Unlock bytes [start, start+length)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


# Mapped segments this process locks on (MappedFile objects of allocator/segment.py), by id.
_LOCKED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def track(mf: Any) -> None:
    """Remember a mapped segment whose open carries locks (re-opened in a forked child)."""
    if id(mf) not in _LOCKED:
        st = os.fstat(mf.fd)
        mf.__dict__["inode"] = (st.st_dev, st.st_ino)
        _LOCKED[id(mf)] = mf


def _fds_of(inode: tuple[int, int]) -> list[int]:
    """This process's descriptors open on the file `inode` (its own and mmap's internal dup)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == inode:
            out.append(int(name))
    return out


def _reopen(mf: Any) -> None:
    """Point one inherited mapping and its descriptors at a new open of the same file."""
    mm: mmap.mmap = mf.mm
    if mm.closed:
        return
    fds = _fds_of(mf.inode)
    src = f"/proc/self/fd/{fds[0]}" if fds else mf.path
    new = os.open(src, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(new)
        if (st.st_dev, st.st_ino) != mf.inode:
            return  # the path names another file now; nothing of ours to re-open
        view = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(view)
        del view
        flags = mmap.MAP_SHARED | _MAP_FIXED
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        got = _libc.mmap(addr, len(mm), prot, flags, new, 0)
        assert got == addr, f"re-mapping the segment after fork failed: errno {ctypes.get_errno()}"
        for fd in fds:
            os.dup2(new, fd, inheritable=False)
    finally:
        os.close(new)


def _reopen_in_child() -> None:
    for mf in list(_LOCKED.values()):
        try:
            _reopen(mf)
        except OSError:
            # Gone or unreadable: the child cannot use that pool anyway.
            pass


os.register_at_fork(after_in_child=_reopen_in_child)
