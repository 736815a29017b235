"""A simulated KV offload (`serve.py --offload`): a finished request's blocks are copied to host
memory by a background thread under a read lease (docs/POOL.md "Leases"), while the engine frees
the request at once and goes on.

The lease is what makes this safe: the request's freed blocks are quarantined until the copy
releases it, so no other request is handed them (and writes its K/V into them) while the thread
still reads. Without it, this is the offload-connector bug where a store read another request's
K/V under the first one's key. Each engine step sweeps the pool for leases past their deadline
(`expire_leases`: a copy that never completes is a `lease_leak`).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from typing import Any

from torch import Tensor

# Requests whose K/V the host store keeps (the oldest are dropped past it).
HOST_REQUESTS = 64
# Copies queued at most (a submit past it waits for the thread).
QUEUE_MAX = 16


class Offloader:
    """One copying thread: `submit(seq)` before the request's free, `close()` at the end."""

    def __init__(self, pool: Any, timeout_s: float = 30.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.host: OrderedDict[str, Tensor] = OrderedDict()
        self.num_offloaded = 0
        self.bytes = 0
        # (bounded: a submit waits, the GIL let go, while the thread is this far behind, so the
        # leases in flight stay few beside the lease table's max_seqs)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_MAX)
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    def submit(self, seq: Any) -> None:
        """Lease a finishing request's blocks and queue their copy (the caller frees it next)."""
        if not seq.block_table:
            return
        lease = self.pool.lease(seq, "read", holder="kv-offload", timeout=self.timeout_s)
        self._queue.put((str(seq.request_id), lease))

    def sweep(self) -> int:
        """Leases past their deadline reported as lease_leak (once each)."""
        return self.pool.expire_leases()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            request, lease = item
            try:
                copy = self.pool.kv[:, :, lease.blocks].to("cpu", copy=True)
                self.host[request] = copy
                self.host.move_to_end(request)
                while len(self.host) > HOST_REQUESTS:
                    self.host.popitem(last=False)
                self.num_offloaded += 1
                self.bytes += copy.numel() * copy.element_size()
            finally:
                lease.release()

    def close(self) -> None:
        """Wait for the copies queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def extra(self) -> dict[str, Any]:
        """The summary's `offload` entry."""
        return {"requests": self.num_offloaded, "bytes": self.bytes}
