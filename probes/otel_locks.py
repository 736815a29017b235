"""Lock wait and hold histograms read from the segment's lock records, not from the lock calls.

Every acquisition adds to its lock's record (docs/FORMAT.md, "Locks"): `num_acquires`, the
time it waited behind another holder (`wait_ns`, contended acquisitions only) and, at release,
the time it held the lock (`hold_ns`). The C core and the Python path write these alike, so an
operation's share of them is the same whichever path ran it. Around each instrumented operation
(under the mapping's op mutex, which the pool's own operations take) the records are read
before and after; for each lock the operation took k times, k values of (added time / k) go
into the histogram: its count and sum are exact, its buckets resolve one operation's mean.

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
# The record's consecutive u8 counters this reads: acquisitions .. hold time.
_FIRST = LOCK_DTYPE.fields["num_acquires"][1] // 8
_ACQ, _WAIT, _HOLD = (
    LOCK_DTYPE.fields[f][1] // 8 - _FIRST for f in ("num_acquires", "wait_ns", "hold_ns")
)
_LAST = LOCK_DTYPE.fields["hold_ns"][1] // 8 + 1
assert LOCK_DTYPE.itemsize % 8 == 0 and LOCK_DTYPE.fields["num_acquires"][1] % 8 == 0


def lock_counts(pool: KVPool) -> np.ndarray | None:
    """A copy of every lock's (acquisitions, contentions, wait ns, hold ns); None once closed."""
    if pool._closed:
        return None
    words = pool.view.locks.view(np.uint64).reshape(-1, _WORDS)
    return words[:, _FIRST:_LAST].copy()


class LockTimes:
    """Records what operations add to the lock records into wait and hold histograms."""

    def __init__(self, wait_hist: Any, hold_hist: Any):
        self.wait_hist = wait_hist
        self.hold_hist = hold_hist

    snapshot = staticmethod(lock_counts)

    def record(self, pool: KVPool, before: np.ndarray | None) -> None:
        """Record, per lock, what was added to its record since `before` (this operation's)."""
        after = lock_counts(pool)
        if before is None or after is None or after.shape != before.shape:
            return
        added = after - before  # u8: a counter that went down (a torn read) wraps; skipped
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
