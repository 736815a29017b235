"""The KV data behind a dump or a live CPU pool, for the data checks of `check` / `analyze`
(allocator/integrity.py: digests of published blocks, poison of freed ones, guard canaries).

A dump written with `--with-data` carries its pool's KV bytes; a live CPU pool's are in its data
file. Both are mapped read-only and read as bits with numpy (allocator/kvbits.py): no torch, no
attaching. A CUDA pool's live data is not read (attach and `pool.check()`, or dump it with
`--with-data`), nor a dump without data: their reports say which checks did not run
(`KVData.unchecked`).
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.allocator.errors import PoolError
from kvscope.allocator.integrity import has_digest, has_guard
from kvscope.allocator.kvbits import KVBits, kv_bits
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.segment import data_path, open_existing, release, segment_path, view_of
from kvscope.allocator.snapshot import snapshot


@dataclass
class KVData:
    """A pool's KV data as bits (None when it could not be read: `unchecked` says why), and for
    a live pool a way to read its records again."""

    bits: KVBits | None
    again: Callable[[], SegmentView] | None = None
    unchecked: str | None = None


def _sized(data: np.ndarray, view: SegmentView) -> bool:
    return len(data) >= int(view.h["data_bytes"])


def has_data_checks(view: SegmentView) -> bool:
    """True when a data check applies to the pool: its blocks carry a guard slot (canaries,
    poison) or a block holds a digest. Without one the KV data is never read."""
    blocks = view.blocks
    ids = np.flatnonzero(blocks["kv_digest"] != 0)
    return has_guard(view) or bool(has_digest(blocks, ids).any())


def _skipped(why: str) -> KVData:
    return KVData(
        None, unchecked=f"{why}: digests, poison and guard canaries of the KV data were not checked"
    )


def for_dump(path: str, view: SegmentView, dump_header: np.void | None) -> KVData | None:
    """The KV data a dump carries (None when no data check applies to its pool)."""
    from kvscope.allocator.dumpread import read_dump_data

    if dump_header is None or not has_data_checks(view):
        return None
    data = read_dump_data(path, dump_header)
    if data is None:
        return _skipped("the dump carries no KV data (written without --with-data)")
    if not _sized(data, view):
        return _skipped("the dump's KV data is shorter than its pool's geometry")
    return KVData(kv_bits(view, data))


def read_live(name: str, trust_owner: bool = False) -> SegmentView:
    """A seqlock-consistent copy of the live pool `name` (takes no lock, writes nothing)."""
    mf = open_existing(segment_path(name), name, trust_owner)
    try:
        return snapshot(view_of(mf))
    except ValueError as e:
        # A geometry that passed the header's checks but lays out more than the file holds.
        raise PoolError(
            f"pool {name!r}: its header does not lay out its segment ({e}): the header is corrupt"
        ) from None
    finally:
        release(mf)


def for_live(
    name: str,
    view: SegmentView,
    path: str | None = None,
    trust_owner: bool = False,
    again: Callable[[], SegmentView] | None = None,
) -> KVData | None:
    """A live CPU pool's KV data, mapped read-only from its data file (None when no data check
    applies to the pool). `path` and `again`: where the file lies and how the records are read
    again, for a pool no longer at its name's place (default: by its name)."""
    if not has_data_checks(view):
        return None
    device = bytes(view.h["device"]).decode(errors="replace").strip("\0")
    if device != "cpu":
        return _skipped(
            f"the KV data is on {device} and is not read from the device (attach and call"
            " pool.check(), or `kvscope dump NAME -o FILE --with-data` and analyze the dump)"
        )
    data = _map_regular(path or data_path(name))
    if data is None:
        return _skipped("the pool's KV data file cannot be read")
    if not _sized(data, view):
        return _skipped("the pool's KV data file is shorter than its geometry")

    def by_name() -> SegmentView:
        return read_live(name, trust_owner)

    return KVData(kv_bits(view, data), again or by_name)


def _map_regular(path: str) -> np.ndarray | None:
    """The bytes of the regular file at path, mapped read-only; None for anything else (a
    FIFO is never opened for reading and waited on, a symlink never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        return np.frombuffer(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ), np.uint8)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
