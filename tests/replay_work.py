"""A small seeded serving workload on one pool (tests/test_replay.py): requests behind six
shared prompts, appends, publications, forks, frees and aborts, in an order fixed by the seed;
and one that takes leases (lease_work), for the lease faults.

    python tests/replay_work.py [OPS]      (under `kvscope run --record-ops FILE --inject F`)
"""

from __future__ import annotations

import os
import random
import sys

from kvscope.allocator import KVPool, PoolConfig

CONFIG = dict(
    num_blocks=48, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32"
)


def work(pool: KVPool, n_ops: int, seed: int = 1) -> None:
    """n_ops steps of the workload on `pool` (every request freed at the end)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randrange(3, 14))] for _ in range(6)]
    live = []
    for i in range(n_ops):
        if len(live) < 6 and rng.random() < 0.5:
            live.append(pool.allocate(f"r{i}", prompts[rng.randrange(6)] + [i]))
        elif live:
            s = rng.choice(live)
            x = rng.random()
            if x < 0.5:
                pool.mark_computed(s, len(s.tokens))
                pool.append(s, [rng.randrange(100)])
            elif x < 0.6 and len(live) < 6:
                live.append(pool.fork(s, f"f{i}"))
            else:
                live.remove(s)
                (pool.free if x < 0.9 else pool.abort)(s)
    for s in live:
        pool.free(s)


def lease_work(pool: KVPool, n_ops: int, seed: int = 1) -> None:
    """A seeded serving loop with leases, as examples/scenarios' transfer-after-free and
    lease-leak run it: a request that waits for its remote K/V under a write lease (released
    when the receive completes; resumed where a preemption took its blocks meanwhile), or one
    whose finished K/V is offloaded under a read lease taken before its free and released
    after; and every step the sweep for leases past their deadline (the clock's now)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    for i in range(n_ops // 8):
        s = pool.allocate(f"r{i}", prompts[rng.randrange(4)] + [i])
        if rng.random() < 0.5:
            pool.set_state(s, "waiting")  # its K/V arrives from a prefill worker
            lease = pool.lease(s, "write", holder="kv-receiver", timeout=30)
            lease.release()
            if s.state == "preempted":
                pool.resume(s)
            pool.set_state(s, "running")
        pool.mark_computed(s, len(s.tokens))
        pool.append(s, [rng.randrange(100)])
        offload = pool.lease(s, "read", holder="kv-offload", timeout=30)
        pool.free(s)
        offload.release()
        pool.expire_leases()


if __name__ == "__main__":
    pool = KVPool.create(f"work-{os.getpid()}", PoolConfig(**CONFIG))
    try:
        work(pool, int(sys.argv[1]) if len(sys.argv) > 1 else 400)
    finally:
        pool.close()
        pool.unlink()
