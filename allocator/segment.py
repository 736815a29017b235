"""The shared files behind a pool: create, open and validate `/dev/shm/kvscope.<name>`."""

from __future__ import annotations

import grp
import mmap
import os
import pwd
import re
from dataclasses import dataclass

import numpy as np

from kvscope.allocator.errors import PoolError
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
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def segment_path(name: str) -> str:
    """Path of a pool's metadata segment."""
    return os.path.join(SHM_DIR, PREFIX + name)


def data_path(name: str) -> str:
    """Path of a CPU pool's KV data file."""
    return segment_path(name) + ".data"


def check_name(name: str) -> str:
    """Reject pool names that are not a plain file-name component."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith(".data"):
        raise PoolError(
            f"invalid pool name {name!r}: use 1-64 letters, digits, '_', '-' or '.' (not ending in .data)"
        )
    return name


def list_names() -> list[str]:
    """Names of the pools whose segments exist on this host."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(
        e[len(PREFIX) :] for e in entries if e.startswith(PREFIX) and not e.endswith(".data")
    )


@dataclass
class MappedFile:
    """One open, mapped segment file, shared by every handle on it in this process."""

    path: str
    fd: int
    mm: mmap.mmap
    users: int = 1


# fcntl locks belong to (process, file): closing ANY descriptor of the file drops them all, so a
# process keeps exactly one descriptor per segment, shared by every pool handle it opens.
_OPEN: dict[str, MappedFile] = {}


def _forget_after_fork() -> None:
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _owner_message(path: str, st: os.stat_result) -> str:
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return f"pool file {path} belongs to user {owner} (mode {st.st_mode & 0o777:o}); run as that user or ask them to create the pool with PoolConfig(group=...)"


def shm_free_bytes() -> int:
    """Free bytes in the shared-memory filesystem."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_file(path: str, size: int, group: str | None) -> int:
    """Create a new file of `size` bytes, mode 0600 (0660 and chgrp with a group); return its fd."""
    mode = 0o660 if group else 0o600
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    except FileExistsError:
        raise PoolError(
            f"a pool file already exists at {path}; attach to it, pick another name, or remove it with `kvscope check --unlink`"
        ) from None
    except PermissionError:
        raise PoolError(f"cannot create {path}: permission denied") from None
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
        os.unlink(path)
        raise
    return fd


def map_new(path: str, size: int, group: str | None) -> MappedFile:
    """Create and map a segment file."""
    fd = create_file(path, size, group)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mf = MappedFile(path, fd, mm)
    _OPEN[path] = mf
    return mf


def open_existing(path: str, name: str) -> MappedFile:
    """Open and map an existing segment, validating it; raises PoolError with one clear line."""
    if path in _OPEN:
        _OPEN[path].users += 1
        return _OPEN[path]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        known = list_names()
        hint = f" (pools on this host: {', '.join(known)})" if known else " (no pools on this host)"
        raise PoolError(f"no pool named {name!r}: {path} does not exist{hint}") from None
    try:
        fd = os.open(path, os.O_RDWR)
    except PermissionError:
        raise PoolError(_owner_message(path, st)) from None
    try:
        size = os.fstat(fd).st_size
        validate_bytes(os.pread(fd, HEADER_DTYPE.itemsize, 0), size, path)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    mf = MappedFile(path, fd, mm)
    _OPEN[path] = mf
    return mf


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
        raise PoolError(
            f"{where} has format version {int(h['version'])}; this kvscope reads version {FORMAT_VERSION}"
        )
    raw = np.frombuffer(head, np.uint8)
    if header_checksum(raw) != int(h["checksum"]):
        raise PoolError(
            f"{where}: header checksum mismatch (stored {int(h['checksum']):#x}, computed {header_checksum(raw):#x}); the header is corrupt"
        )
    if size < int(h["segment_size"]):
        raise PoolError(
            f"{where} is truncated: {size} bytes, its header says {int(h['segment_size'])}"
        )
    layout = Layout.from_header(h)
    off = layout.offsets()
    if (
        off["end"] != int(h["segment_size"])
        or off["blocks"] != int(h["off_blocks"])
        or off["clients"] != int(h["off_clients"])
    ):
        raise PoolError(
            f"{where}: its section offsets do not match its geometry (written by another kvscope build?); dump it with that build or recreate the pool"
        )
    return layout


def view_of(mf: MappedFile) -> SegmentView:
    """Numpy views over a mapped segment."""
    h = np.frombuffer(mf.mm, HEADER_DTYPE, 1)[0]
    return SegmentView(mf.mm, Layout.from_header(h))
