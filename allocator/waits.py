"""Published lock waits: which pool locks a process waits for, in its client record.

A process that waits for pool locks (its C core: csrc/locks.c lock_get) publishes which ones in
the `op` field of its client record (docs/FORMAT.md section 8), and clears it once it has them:
a reader of a stuck pool sees who waits for what. The core takes locks in the one documented
order, so its waits never close a cycle (but under the `lock-inversion` fault, which takes them
the other way round to make one).
"""

from __future__ import annotations


def wait_word(first: int, last: int) -> int:
    """The published wait for locks first..last (0 means not waiting)."""
    return (first + 1) | ((last + 1) << 32)
