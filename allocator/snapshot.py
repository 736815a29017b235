"""Consistent lock-free copies of a live segment (the seqlock reader)."""

from __future__ import annotations

import time

import numpy as np

from kvscope.allocator.layout import SegmentView


def _counters(view: SegmentView) -> np.ndarray:
    return np.concatenate([view.locks["seq"], view.clients["seq"]])


def snapshot(view: SegmentView, tries: int = 200) -> SegmentView:
    """Copy the segment while no writer is mid-operation; after `tries`, the last copy (`torn`)."""
    buf = b""
    for attempt in range(tries):
        before = _counters(view).copy()
        if (before % 2).any():
            time.sleep(0.0001 * min(attempt + 1, 10))
            continue
        buf = view.raw.tobytes()
        if np.array_equal(before, _counters(view)):
            out = SegmentView(bytearray(buf), view.layout)
            out.torn = False  # type: ignore[attr-defined]
            return out
    if not buf:
        buf = view.raw.tobytes()
    out = SegmentView(bytearray(buf), view.layout)
    out.torn = True  # type: ignore[attr-defined]
    return out
