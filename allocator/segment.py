"""The shared files behind a pool: create, open and validate `/dev/shm/kvscope.<name>`."""

from __future__ import annotations

import grp
import mmap
import os
import pwd
import re
import stat
from dataclasses import dataclass

import numpy as np

from kvscope.allocator.errors import FormatVersionError, PoolError
from kvscope.allocator.geometry import geometry_problem
from kvscope.allocator.layout import (
    FORMAT_VERSION,
    HEADER_DTYPE,
    POOL_MAGIC,
    Layout,
    SegmentView,
    header_checksum,
)

SHM_DIR = os.environ.get("KVSCOPE_SHM_DIR", "/dev/shm")
PREFIX = "kvscope."
# A plain file-name component: no leading '-' or '.', no control characters. Matched with
# fullmatch: a `$` would let a trailing newline through.
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
# KVSCOPE_TRUST_OWNER=1: attach to pools owned by another user (as --trust-owner does).
TRUST_ENV = "KVSCOPE_TRUST_OWNER"

# Pool names a "no pool named" error lists at most.
KNOWN_SHOWN = 10


def segment_path(name: str) -> str:
    """Path of a pool's metadata segment."""
    return os.path.join(SHM_DIR, PREFIX + name)


def data_path(name: str) -> str:
    """Path of a CPU pool's KV data file."""
    return segment_path(name) + ".data"


def check_name(name: str) -> str:
    """Reject pool names that are not a plain file-name component."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.endswith(".data"):
        raise PoolError(
            f"invalid pool name {name!r}: use 1-64 letters, digits, '_', '-' or '.', starting"
            " with a letter, digit or '_' (not ending in .data)"
        )
    return name


def list_names() -> list[str]:
    """Names of the pools whose segments exist on this host (regular files only)."""
    try:
        with os.scandir(SHM_DIR) as it:
            entries = [e.name for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(
        e[len(PREFIX) :] for e in entries if e.startswith(PREFIX) and not e.endswith(".data")
    )


def trust_from_env() -> bool:
    """True when KVSCOPE_TRUST_OWNER asks to attach to other users' pools."""
    return os.environ.get(TRUST_ENV, "") not in ("", "0", "false", "no", "off")


@dataclass
class MappedFile:
    """One open, mapped segment file, shared by every handle on it in this process."""

    path: str
    fd: int
    mm: mmap.mmap
    users: int = 1
    # The file's owner: the pool's data file must belong to the same user.
    uid: int = -1


# A process opens each segment once, shared by every pool handle it opens: the client-registration
# OFD lock belongs to that open (allocator/ofd.py), and the locks of two opens in one process
# would exclude each other; the handles share the pool locks' thread locks through it too.
_OPEN: dict[str, MappedFile] = {}
# path -> (device, inode) of each file this process created: a failed create removes only those.
_CREATED: dict[str, tuple[int, int]] = {}


def _forget_after_fork() -> None:
    _OPEN.clear()
    _CREATED.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _owner_message(path: str, st: os.stat_result) -> str:
    return f"pool file {path} belongs to user {_user(st.st_uid)} (mode {st.st_mode & 0o777:o}); run as that user or ask them to create the pool with PoolConfig(group=...)"


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def check_file(path: str, st: os.stat_result, trust_owner: bool) -> None:
    """Refuse a pool file that is not a regular file, or that another user owns or can write.

    Another user's file is attached only when asked (`trust_owner`): its owner can read every
    request and token in it and rewrite any byte of it while we use it.
    """
    if not stat.S_ISREG(st.st_mode):
        raise PoolError(
            f"{path} is {_kind(st.st_mode)}, not a pool file; remove it or pick another pool name"
        )
    if trust_owner or trust_from_env():
        return
    me = os.geteuid()
    if st.st_uid != me:
        raise PoolError(
            f"{path} belongs to user {_user(st.st_uid)}, not to you ({_user(me)}); "
            "kvscope attaches only to your own pools: pass --trust-owner (or KVSCOPE_TRUST_OWNER=1, "
            "KVPool.attach(name, trust_owner=True)) if you trust that user"
        )
    if st.st_mode & 0o002:
        raise PoolError(
            f"{path} is writable by every user (mode {st.st_mode & 0o777:o}): anyone may have "
            "changed it; remove it, or pass --trust-owner (KVSCOPE_TRUST_OWNER=1) to use it anyway"
        )


def open_file(
    path: str,
    name: str,
    *,
    trust_owner: bool,
    missing: str | None = None,
    owner: int = -1,
    writable: bool = True,
) -> int:
    """Open an existing pool file without following a symlink or blocking on a FIFO, checked
    by `check_file`; raises PoolError with one clear line.

    Args:
        missing: the message when the file does not exist (default: no pool named `name`).
        owner: when >= 0, the uid that must own the file (a data file: its segment's owner).
        writable: open it read-write (False: read-only, for readers such as the TUI).
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if missing is not None:
            raise PoolError(missing) from None
        known = list_names()
        # (a few names, not a busy host's hundreds on one line: `kvscope ls` lists them all)
        shown = ", ".join(known[:KNOWN_SHOWN])
        more = (
            f" and {len(known) - KNOWN_SHOWN} more: kvscope ls" if len(known) > KNOWN_SHOWN else ""
        )
        hint = f" (pools on this host: {shown}{more})" if known else " (no pools on this host)"
        raise PoolError(f"no pool named {name!r}: {path} does not exist{hint}") from None
    except PermissionError:
        try:
            st = os.lstat(path)
        except OSError:
            raise PoolError(f"cannot open {path}: permission denied") from None
        raise PoolError(_owner_message(path, st)) from None
    except OSError as e:
        try:
            st = os.lstat(path)
        except OSError:
            raise PoolError(f"cannot open {path}: {e.strerror}") from None
        if stat.S_ISREG(st.st_mode):
            raise PoolError(f"cannot open {path}: {e.strerror}") from None
        raise PoolError(
            f"{path} is {_kind(st.st_mode)}, not a pool file; remove it or pick another pool name"
        ) from None
    try:
        st = os.fstat(fd)
        check_file(path, st, trust_owner)
        if owner >= 0 and st.st_uid != owner:
            raise PoolError(
                f"{path} belongs to user {_user(st.st_uid)} but its pool to user {_user(owner)}: "
                "someone else put it there; remove the pool's files and create it again"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def shm_free_bytes() -> int:
    """Free bytes in the shared-memory filesystem."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_file(path: str, size: int, group: str | None) -> int:
    """Create a new file of `size` bytes, mode 0600 (0660 and chgrp with a group); return its fd."""
    mode = 0o660 if group else 0o600
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        raise PoolError(
            f"a pool file already exists at {path}; attach to it, pick another name, or remove it with `kvscope check --unlink`"
        ) from None
    except PermissionError:
        raise PoolError(f"cannot create {path}: permission denied") from None
    except OSError as e:
        raise PoolError(f"cannot create {path}: {e.strerror}") from None
    st = os.fstat(fd)
    _CREATED[path] = (st.st_dev, st.st_ino)
    try:
        if group:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise PoolError(f"unknown group {group!r} in PoolConfig.group") from None
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        remove_if_created(path)
        raise
    return fd


def remove_if_created(path: str) -> None:
    """Unlink `path` if the file there is one this process created (a failed create must never
    remove a file it did not make, such as another user's, or one that replaced ours)."""
    made = _CREATED.pop(path, None)
    if made is None:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == made:
        os.unlink(path)


def map_new(path: str, size: int, group: str | None) -> MappedFile:
    """Create and map a segment file."""
    fd = create_file(path, size, group)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mf = MappedFile(path, fd, mm, uid=os.fstat(fd).st_uid)
    _OPEN[path] = mf
    return mf


def open_existing(path: str, name: str, trust_owner: bool = False) -> MappedFile:
    """Open and map an existing segment, validating it; raises PoolError with one clear line.

    Args:
        trust_owner: attach even when another user owns the file (or everyone may write it);
            KVSCOPE_TRUST_OWNER=1 does the same.
    """
    if path in _OPEN:
        mf = _OPEN[path]
        check_size(mf.fd, len(mf.mm), path)
        mf.users += 1
        return mf
    fd = open_file(path, name, trust_owner=trust_owner)
    try:
        st = os.fstat(fd)
        validate_bytes(os.pread(fd, HEADER_DTYPE.itemsize, 0), st.st_size, path)
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    mf = MappedFile(path, fd, mm, uid=st.st_uid)
    _OPEN[path] = mf
    return mf


def check_size(fd: int, need: int, path: str) -> None:
    """PoolError when the file behind fd is shorter than `need` bytes (truncated since it was
    mapped: touching the missing pages would kill the process with SIGBUS)."""
    size = os.fstat(fd).st_size
    if size < need:
        raise PoolError(
            f"{path} is truncated: {size} bytes, the pool needs {need}; every process using it will crash: recreate the pool"
        )


def release(mf: MappedFile) -> None:
    """Drop one user of a mapped file; unmap and close it after the last."""
    mf.users -= 1
    if mf.users > 0:
        return
    _OPEN.pop(mf.path, None)
    try:
        mf.mm.close()
    except BufferError:
        # numpy views still reference the map; the OS unmaps it at exit.
        pass
    os.close(mf.fd)


def validate_bytes(head: bytes, size: int, where: str) -> Layout:
    """Check magic, version, checksum and size of a segment image; return its layout."""
    if len(head) < HEADER_DTYPE.itemsize:
        raise PoolError(
            f"{where} is truncated: {len(head)} bytes, a kvscope segment header needs {HEADER_DTYPE.itemsize}"
        )
    h = np.frombuffer(head, HEADER_DTYPE, 1)[0]
    if int(h["magic"]) != POOL_MAGIC:
        raise PoolError(
            f"{where} is not a kvscope pool: magic {int(h['magic']):#018x}, expected {POOL_MAGIC:#018x}"
        )
    if int(h["version"]) != FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} has format version {int(h['version'])}; this kvscope reads version {FORMAT_VERSION}",
            int(h["version"]),
        )
    raw = np.frombuffer(head, np.uint8)
    if header_checksum(raw) != int(h["checksum"]):
        raise PoolError(
            f"{where}: header checksum mismatch (stored {int(h['checksum']):#x}, computed {header_checksum(raw):#x}); the header is corrupt"
        )
    problem = geometry_problem(h)
    if problem is not None:
        raise PoolError(
            f"{where}: its header cannot be used ({problem}); the file is damaged or was written by another kvscope build"
        )
    if size < int(h["segment_size"]):
        raise PoolError(
            f"{where} is truncated: {size} bytes, its header says {int(h['segment_size'])}"
        )
    return Layout.from_header(h)


def view_of(mf: MappedFile) -> SegmentView:
    """Numpy views over a mapped segment."""
    h = np.frombuffer(mf.mm, HEADER_DTYPE, 1)[0]
    return SegmentView(mf.mm, Layout.from_header(h))
