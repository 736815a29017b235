"""Scenario: A KV transfer into a request's blocks completes after a preemption freed them.

Disaggregated decode: each request's destination blocks are allocated and the request waits for
its remote K/V, which a receiver thread writes under a write lease. With the fault, the
scheduler preempts a waiting request in the same step as the receive it queued (the pool frees
its blocks); the receive lands anyway. The lease keeps the freed blocks quarantined, so no
other request gets them, and its release reports the late write as transfer_after_free,
naming the receiver and the request.

kvscope run examples/scenarios/transfer_after_free.py
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from kvscope.allocator import KVPool, PoolConfig, faults


def receive(pool, blocks):
    """The remote K/V of a request written into its blocks (the pool's KV tensor)."""
    for b in blocks:
        pool.kv[:, :, b, : pool.block_size] = 0.5


def main() -> int:
    if not faults.ARMED:
        faults.configure("transfer-after-free")
    cfg = PoolConfig(num_blocks=64, block_size=4, num_layers=1, head_dim=8, dtype="float32")
    pool = KVPool.create(f"serve-{os.getpid()}", cfg)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="kv-receiver") as receiver:
            for i in range(8):
                seq = pool.allocate(f"req-{i}", list(range(100 * i, 100 * i + 10)))
                pool.set_state(seq, "waiting")  # waiting for its remote K/V
                lease = pool.lease(seq, "write", holder="kv-receiver")
                done = receiver.submit(receive, pool, lease.blocks)
                lease.release_when(done)
                done.result()
                if seq.state == "preempted":
                    pool.resume(seq)  # its K/V is recomputed: the receive was lost
                pool.set_state(seq, "running")
                pool.append(seq, [1, 2])
                pool.free(seq)
    finally:
        pool.close()
        pool.unlink()
    print("served 8 requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
