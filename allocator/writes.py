"""The probes on the K/V data between operations (part of a handle's PoolProbes).

The C core checks the K/V in its own operations (allocator/csrc/kvdata.c) and reports what it
finds itself: on a CPU pool's bytes, or, for data it cannot reach (a CUDA pool), through its
queue of checks, launched and answered later (devicechecks.py: `later`), so that no operation
waits for the GPU. What is left to the handle:

- **answers** of that queue, taken between operations (`settle`).

Guard mode's check of a finished request's K/V (its slots still poisoned: `kv_never_written`)
is the core's, in the free's call (csrc/entry.c finish_check).

`pool.verify()` scans every block's guard slot itself (PoolProbes.scan_canaries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.allocator import devicechecks

if TYPE_CHECKING:
    from kvscope.allocator.handle import PoolHandle
    from kvscope.allocator.probeflags import ProbeFlags


class WriteProbes:
    """The K/V probes of one pool handle (part of its PoolProbes), with these flags."""

    def __init__(self, pool: PoolHandle, flags: ProbeFlags):
        self.pool = pool
        # The C core's queue of checks of the K/V, answered later (a CUDA pool; a CPU pool's
        # core reads the bytes itself).
        self.later = devicechecks.for_pool(pool, flags)

    def settle(self, wait: bool = False) -> None:
        """The answers of the checks launched on the GPU that are in (all, with `wait`)."""
        if self.later is not None:
            self.later.settle(wait)
