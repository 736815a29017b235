"""Lock wait and hold histograms read from the segment's lock records, not from the lock calls.

Every acquisition adds to its lock's record (docs/FORMAT.md, "Locks"): `num_acquires`, the
time it waited behind another holder (`wait_ns`, contended acquisitions only) and, at release,
the time it held the lock (`hold_ns`), written by whoever takes it (the C core for every
operation). Around each instrumented operation (under the mapping's op mutex, which the pool's
own operations take) the records are read before and after; for each lock the operation took k
times, k values of (added time / k) go into the histogram: its count and sum are exact, its
buckets resolve one operation's mean.

    times = LockTimes(wait_hist, hold_hist)
    before = times.snapshot(pool)
    ...                                    # the operation
    times.record(pool, before)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator.layout import LOCK_DTYPE

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool

POOL = "kvscope.pool.name"
DEVICE = "kvscope.pool.device"
LOCK = "kvscope.lock.name"

_WORDS = LOCK_DTYPE.itemsize // 8
_FIELDS = LOCK_DTYPE.fields
assert _FIELDS is not None and LOCK_DTYPE.itemsize % 8 == 0
_ACQ, _WAIT, _HOLD = (_FIELDS[f][1] // 8 for f in ("num_acquires", "wait_ns", "hold_ns"))
assert _FIELDS["num_acquires"][1] % 8 == 0


def lock_bytes(pool: KVPool) -> bytes | None:
    """A copy of the pool's lock records (about 1 KiB: cheaper than any numpy step); None
    once the handle is closed."""
    if pool.closed:
        return None
    return pool.view.locks.tobytes()


class LockTimes:
    """Records what operations add to the lock records into wait and hold histograms."""

    def __init__(self, wait_hist: Any, hold_hist: Any):
        self.wait_hist = wait_hist
        self.hold_hist = hold_hist

    snapshot = staticmethod(lock_bytes)

    def record(self, pool: KVPool, before: bytes | None) -> None:
        """Record, per lock, what was added to its record since `before` (this operation's)."""
        after = lock_bytes(pool)
        if before is None or after is None or after == before or len(after) != len(before):
            return  # most appends take no pool lock
        # u8 differences: a counter that went down (a torn read) wraps, and is skipped below.
        added = np.frombuffer(after, np.uint64).reshape(-1, _WORDS) - np.frombuffer(
            before, np.uint64
        ).reshape(-1, _WORDS)
        attrs = None
        for i in np.flatnonzero(added[:, _ACQ]).tolist():
            k, wait, hold = (int(x) for x in added[i, [_ACQ, _WAIT, _HOLD]])
            if k > 1 << 32 or wait > 1 << 62 or hold > 1 << 62:
                continue
            if attrs is None:
                attrs = {POOL: pool.name, DEVICE: pool.config.device}
            a = {**attrs, LOCK: pool.locks.names[i]}
            for _ in range(k):
                self.wait_hist.record(wait * 1e-9 / k, a)
                self.hold_hist.record(hold * 1e-9 / k, a)
