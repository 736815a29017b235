"""The probes on the K/V data between operations (part of a handle's PoolProbes).

The C core checks the K/V in its own operations (allocator/csrc/kvdata.c) and reports what it
finds itself: on a CPU pool's bytes, or, for data it cannot reach (a CUDA pool), through its
queue of checks, launched and answered later (devicechecks.py: `later`), so that no operation
waits for the GPU. What is left to the handle:

- **answers** of that queue, taken between operations (`settle`);
- **unwritten slots** (guard mode): a finished request's K/V slots still poisoned, checked by
  the core when it is freed (`finished`: `kv_never_written`).

`pool.verify()` scans every block's guard slot itself (PoolProbes.scan_canaries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.allocator import devicechecks, integrity

if TYPE_CHECKING:
    from kvscope.allocator.handle import PoolHandle
    from kvscope.allocator.probeflags import ProbeFlags
    from kvscope.allocator.sequence import Sequence


class WriteProbes:
    """The K/V probes of one pool handle (part of its PoolProbes), with these flags."""

    def __init__(self, pool: PoolHandle, flags: ProbeFlags):
        self.pool = pool
        # The C core's queue of checks of the K/V, answered later (a CUDA pool; a CPU pool's
        # core reads the bytes itself).
        self.later = devicechecks.for_pool(pool, flags)
        self.guard = flags.guard and integrity.can_poison(pool.kv)

    def finished(self, seq: Sequence) -> None:
        """Guard mode, a request that finished (not aborted): the K/V of every position but
        its last was written into its own blocks (an engine may end a request before feeding
        back its last sampled token). Token slots still poisoned, from the pool's creation or
        the block's last free, mean the writes went elsewhere: `kv_never_written`, reported by
        the core (now on a CPU pool, at the next settle on a CUDA pool)."""
        if not self.guard or not seq.block_table:
            return
        pool = self.pool
        # (the table as it is: the core reads it within the call, keeping none of it)
        with pool.op_mutex:  # (queued as the core queues its checks)
            pool.core.unwritten(seq.block_table, len(seq.tokens) - 1, str(seq.request_id))

    def settle(self, wait: bool = False) -> None:
        """The answers of the checks launched on the GPU that are in (all, with `wait`)."""
        if self.later is not None:
            self.later.settle(wait)
