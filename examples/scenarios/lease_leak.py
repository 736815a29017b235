"""Scenario: An offload's read lease is never released: its request's blocks stay quarantined.

A finished request's blocks are copied to host memory by an offload thread under a read lease
while the request is freed at once (the lease keeps the freed blocks out of other requests'
hands until the copy is done). With the fault, one copy's completion never releases its lease
(a "finished sending" that never came): the lease outlives its request, and the pool reports
it as lease_leak, naming the offloader, when its holder closes the pool.

kvscope run examples/scenarios/lease_leak.py
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from kvscope.allocator import KVPool, PoolConfig, faults


def offload(pool, blocks):
    """A request's K/V copied to host memory."""
    return pool.kv[:, :, blocks].clone()


def main() -> int:
    if not faults.ARMED:
        faults.configure("lease-leak")
    cfg = PoolConfig(num_blocks=64, block_size=4, num_layers=1, head_dim=8, dtype="float32")
    pool = KVPool.create(f"serve-{os.getpid()}", cfg)
    host = []
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="offloader") as offloader:
            copies = []
            for i in range(8):
                seq = pool.allocate(f"req-{i}", list(range(100 * i, 100 * i + 10)))
                pool.kv[:, :, seq.block_table, : pool.block_size] = float(i)
                lease = pool.lease(seq, "read", holder="offloader")
                copy = offloader.submit(offload, pool, lease.blocks)
                lease.release_when(copy)
                copies.append(copy)
                pool.free(seq)  # the request ends while its K/V is still being copied
            host = [c.result() for c in copies]
    finally:
        pool.close()
        pool.unlink()
    print(f"offloaded {len(host)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
