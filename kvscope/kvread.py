"""The KV data behind a dump or a live CPU pool, for the data checks of `check` / `analyze`
(allocator/integrity.py: digests of published blocks, poison of freed ones, guard canaries).

A dump written with `--with-data` carries its pool's KV bytes; a live CPU pool's are in its data
file, read without attaching. A CUDA pool's live data is not read (attach and `pool.check()`
instead), nor a dump without data: their reports have no data checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.integrity import has_digest, has_guard, kv_from_bytes
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.segment import data_path

if TYPE_CHECKING:
    import torch


@dataclass
class KVData:
    """A pool's KV tensor, and for a live pool a way to read its records again."""

    tensor: torch.Tensor
    again: Callable[[], SegmentView] | None = None


def _sized(data: np.ndarray, view: SegmentView) -> bool:
    return len(data) >= int(view.h["data_bytes"])


def has_data_checks(view: SegmentView) -> bool:
    """True when a data check applies to the pool: its blocks carry a guard slot (canaries,
    poison) or a block holds a digest. Without one the KV tensor, and torch, are never needed."""
    blocks = view.blocks
    ids = np.flatnonzero(blocks["kv_digest"] != 0)
    return has_guard(view) or bool(has_digest(blocks, ids).any())


def for_dump(path: str, view: SegmentView, dump_header: np.void | None) -> KVData | None:
    """The KV data a dump carries (None without `--with-data`, or when it is short)."""
    from kvscope.allocator.dumpfile import read_dump_data

    if dump_header is None or not has_data_checks(view):
        return None
    data = read_dump_data(path, dump_header)
    if data is None or not _sized(data, view):
        return None
    return KVData(kv_from_bytes(view, data))


def for_live(name: str, view: SegmentView) -> KVData | None:
    """A live CPU pool's KV data, mapped read-only from its data file (None when unreadable)."""
    if bytes(view.h["device"]).decode(errors="replace").strip("\0") != "cpu":
        return None
    if not has_data_checks(view):
        return None
    try:
        data = np.memmap(data_path(name), np.uint8, "r")
    except (OSError, ValueError):
        return None
    if not _sized(data, view):
        return None

    def again() -> SegmentView:
        from kvscope.target import read_live

        return read_live(name)

    return KVData(kv_from_bytes(view, data), again)


def for_target(target: str, view: SegmentView, dump_header: np.void | None) -> KVData | None:
    """`for_dump` or `for_live`, as `open_target` resolved `target`."""
    from kvscope.target import looks_like_path

    if looks_like_path(target):
        return for_dump(os.fspath(target), view, dump_header)
    return for_live(target, view)
