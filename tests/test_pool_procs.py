"""Real processes sharing one pool: thousands of operations each, shared prefixes, no block lost."""

from __future__ import annotations

import os
import random
import traceback

import pytest

from kvscope.allocator import KVPool, PoolExhausted
from tests.test_pool_model import kv_values

BS = 4
SYSTEM_PROMPTS = [[100 + i] * 8 + [i, i + 1, i + 2, i + 3] for i in range(5)]


def _worker(name: str, seed: int, ops: int) -> int:
    """Random operations on an attached pool; verifies its sequences' KV; returns an exit code."""
    pool = KVPool.attach(name)
    rng = random.Random(seed)
    live = []
    kv = pool.kv

    def write(seq, start):
        vals = kv_values(seq.tokens)
        for p in range(start, seq.num_tokens):
            kv[0, 0, seq.block_table[p // BS], p % BS, 0, 0] = vals[p]
        pool.mark_computed(seq, seq.num_tokens)

    for i in range(ops):
        r = rng.random()
        try:
            if r < 0.3 or not live:
                prompt = rng.choice(SYSTEM_PROMPTS) + [
                    rng.randrange(50) for _ in range(rng.randrange(1, 9))
                ]
                seq = pool.allocate(f"w{seed}-{i}", prompt)
                write(seq, seq.num_cached_tokens)
                live.append(seq)
            elif r < 0.65:
                seq = rng.choice(live)
                start = seq.num_tokens
                for src, dst in pool.append(
                    seq, [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
                ):
                    kv[:, :, dst] = kv[:, :, src]
                write(seq, start)
            elif r < 0.72 and len(live) < 12:
                live.append(pool.fork(rng.choice(live), f"w{seed}-f{i}"))
            else:
                seq = live.pop(rng.randrange(len(live)))
                # The KV read through the table must be this prompt's, even for blocks other
                # processes computed.
                got = [
                    float(kv[0, 0, seq.block_table[p // BS], p % BS, 0, 0])
                    for p in range(seq.num_tokens)
                ]
                if got != kv_values(seq.tokens):
                    print(f"worker {seed}: {seq.request_id} read foreign KV", flush=True)
                    return 3
                pool.free(seq)
        except PoolExhausted:
            if live:
                pool.free(live.pop(0))
    for seq in live:
        pool.free(seq)
    pool.close()
    return 0


# max_clients 8 (the parent and 4 workers): each process keeps a slot reserve; 32: none, every
# claim of a sequence slot takes the seqs lock.
@pytest.mark.slow
@pytest.mark.parametrize("max_clients", [32, 8])
def test_four_processes_share_one_pool_without_losing_a_block(make_pool, max_clients):
    # GIVEN one pool and 4 processes attached to it
    pool = make_pool(
        256, block_size=BS, num_kv_heads=1, head_dim=1, local_cache_size=4, max_clients=max_clients
    )
    ops = int(os.environ.get("KVSCOPE_PROC_OPS", "1500"))
    pids = []
    for w in range(4):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _worker(pool.name, w, ops)
            except BaseException:
                traceback.print_exc()
            os._exit(code)
        pids.append(pid)
    # WHEN each runs thousands of random operations with shared prefixes
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    # THEN every worker read only its own prompts' KV, the pool is consistent and no block is lost
    assert codes == [0, 0, 0, 0]
    assert pool.check() == []
    st = pool.stats()
    assert st["num_allocated"] == 0 and st["num_sequences"] == 0
    assert st["num_free"] + st["num_cached"] + st["num_local"] == 256
    assert st["prefix_hits"] > 0
    assert st["num_allocs"] > 4 * ops // 4
