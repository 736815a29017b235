"""Reading dump files (dumpfile.py writes them): one clear PoolError line for anything that is
not a usable dump, never a traceback, a hang on a FIFO or a read past the file's end.

    view, dump_header = read_dump("demo.kvd")      # a SegmentView, as of a live pool
    data = read_dump_data("demo.kvd", dump_header)  # the KV bytes, when dumped with them
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable
from io import BufferedReader

import numpy as np

from kvscope.allocator.dumpfile import SAVED_HEADER_BYTES, host_name, layout_of_prefix
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import (
    DUMP_HEADER_DTYPE,
    DUMP_MAGIC,
    DUMP_VERSION,
    DUMP_WITH_DATA,
    HEADER_DTYPE,
    POOL_MAGIC,
    Layout,
    SegmentView,
)
from kvscope.allocator.process import is_alive
from kvscope.allocator.segment import validate_bytes


def _open(path: str) -> BufferedReader:
    """Open a dump file for reading: a regular file (a FIFO or a device is refused, never
    waited on); every failure is one PoolError line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PoolError(f"no dump file at {path}") from None
    except IsADirectoryError:
        raise PoolError(f"{path} is a directory, not a dump file") from None
    except PermissionError:
        raise PoolError(
            f"cannot read {path}: permission denied (dump files are mode 0600; run as their owner)"
        ) from None
    except OSError as e:
        raise PoolError(f"cannot read {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise PoolError(f"{path} is a directory, not a dump file")
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PoolError(f"{path} is not a regular file, not a dump file")
    return os.fdopen(fd, "rb")


def read_dump(path: str | os.PathLike[str]) -> tuple[SegmentView, np.void]:
    """Read a dump file (or a raw copy of a segment); PoolError with one clear line if unusable."""
    path = os.fspath(path)
    with _open(path) as f:
        try:
            return _read(f, path)
        except OSError as e:
            raise PoolError(f"cannot read {path}: {e.strerror}") from None


def read_dump_header(path: str | os.PathLike[str]) -> np.void:
    """The header of a dump file this kvscope wrote (what `kvscope run` says of the dump it
    just wrote is what `analyze` will read); PoolError with one line if it has none."""
    path = os.fspath(path)
    with _open(path) as f:
        head = f.read(DUMP_HEADER_DTYPE.itemsize)
    if len(head) < DUMP_HEADER_DTYPE.itemsize or int.from_bytes(head[:8], "little") != DUMP_MAGIC:
        raise PoolError(f"{path} does not start with a dump header")
    return np.frombuffer(head, DUMP_HEADER_DTYPE, 1)[0]


def _read(f: BufferedReader, path: str) -> tuple[SegmentView, np.void]:
    size = os.fstat(f.fileno()).st_size
    head = f.read(DUMP_HEADER_DTYPE.itemsize)
    magic = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
    if magic == POOL_MAGIC:
        return _read_raw_segment(f, path, size, head)
    if magic != DUMP_MAGIC:
        if len(head) < 8 and DUMP_MAGIC.to_bytes(8, "little").startswith(head):
            raise PoolError(f"{path} is truncated: {size} bytes, not even a dump header")
        raise PoolError(f"{path} is not a kvscope dump (it does not start with the dump magic)")
    if len(head) < DUMP_HEADER_DTYPE.itemsize:
        raise PoolError(
            f"{path} is truncated: {size} bytes, a dump header needs {DUMP_HEADER_DTYPE.itemsize}"
        )
    dh = np.frombuffer(head, DUMP_HEADER_DTYPE, 1)[0]
    if int(dh["version"]) != DUMP_VERSION:
        raise PoolError(
            f"{path} is a version {int(dh['version'])} dump; this kvscope reads version {DUMP_VERSION}"
        )
    seg_size = int(dh["segment_size"])
    want = DUMP_HEADER_DTYPE.itemsize + seg_size
    if int(dh["flags"]) & DUMP_WITH_DATA:
        want += int(dh["data_size"])
    if size < want:
        raise PoolError(f"{path} is truncated: {size} bytes, its header says {want}")
    # Sized by the file: a segment_size that claims more than the file holds was refused above.
    seg = _segment_bytes(f, DUMP_HEADER_DTYPE.itemsize, seg_size, path)
    saved = bytes(dh["segment_header_prefix"][:SAVED_HEADER_BYTES])
    view = SegmentView(seg, _layout(seg, seg_size, path, saved))
    # check_header names a changed header field against this copy (kvscope.allocator.check).
    view.intact_header = saved if layout_of_prefix(saved) is not None else None  # type: ignore[attr-defined]
    return view, dh


def _segment_bytes(f: BufferedReader, offset: int, size: int, path: str) -> memoryview | bytearray:
    """The segment's `size` bytes at `offset` of the file: mapped copy-on-write (pages are read
    as the analysis touches them and nothing is copied: a 300 MiB dump maps in milliseconds where
    reading it took most of a second), or read into memory where the file cannot be mapped.

    A dump is written whole and renamed into place (`write_dump`), so no writer cuts it short
    under a reader; one truncated by hand while it is read kills the reader with SIGBUS, as a
    live pool's segment cut short under `read_live` does."""
    try:
        mm = mmap.mmap(f.fileno(), offset + size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        f.seek(offset)
        seg = bytearray(size)
        if f.readinto(seg) != size:
            raise PoolError(f"{path} is truncated: it ended while its segment was read") from None
        return seg
    return memoryview(mm)[offset : offset + size]


def _layout(seg: bytearray | memoryview, seg_size: int, where: str, saved: bytes) -> Layout:
    """The segment's layout; when its own header is corrupt, the one the dumper saved."""
    try:
        layout = validate_bytes(bytes(seg[: HEADER_DTYPE.itemsize]), seg_size, where)
    except PoolError:
        from_saved = layout_of_prefix(saved)
        if from_saved is None:
            raise
        layout = from_saved
    if layout.offsets()["end"] > seg_size:
        raise PoolError(f"{where} is truncated: its segment is smaller than its geometry")
    return layout


def _read_raw_segment(
    f: BufferedReader, path: str, size: int, head: bytes
) -> tuple[SegmentView, np.void]:
    """A plain copy of /dev/shm/kvscope.NAME read as a dump without a dump header."""
    head += f.read(max(0, HEADER_DTYPE.itemsize - len(head)))
    layout = validate_bytes(head[: HEADER_DTYPE.itemsize], size, path)
    seg_size = layout.offsets()["end"]
    seg = bytearray(seg_size)
    seg[: len(head)] = head[:seg_size]
    if f.readinto(memoryview(seg)[len(head) :]) != seg_size - len(head):
        raise PoolError(f"{path} is truncated: it ended while its segment was read")
    dh = np.zeros(1, DUMP_HEADER_DTYPE)
    dh["magic"], dh["version"], dh["segment_size"] = DUMP_MAGIC, DUMP_VERSION, seg_size
    dh["pool"] = np.frombuffer(seg, HEADER_DTYPE, 1)[0]["name"]
    return SegmentView(seg, layout), dh[0]


def read_dump_data(path: str | os.PathLike[str], dump_header: np.void) -> np.ndarray | None:
    """The KV data bytes of a dump written with data (a read-only memory map), else None."""
    if not int(dump_header["flags"]) & DUMP_WITH_DATA:
        return None
    offset = DUMP_HEADER_DTYPE.itemsize + int(dump_header["segment_size"])
    return np.memmap(
        os.fspath(path), np.uint8, "r", offset=offset, shape=(int(dump_header["data_size"]),)
    )


def alive_for(dump_header: np.void) -> Callable[[int, int], bool]:
    """An `alive(pid, start)` for a dump: processes of another host count as dead."""
    host = bytes(dump_header["host"]).decode(errors="replace")
    if host != host_name():
        return lambda pid, start: False
    return is_alive
