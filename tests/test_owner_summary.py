"""Blocks by owner (kvscope.poolsummary.summary): a block's owner is the process that allocated
it; a shared prefix block that only another process's requests map now is counted apart
(`held_for_others`), so a process that freed all its requests does not look like a leaker."""

from __future__ import annotations

import os

from kvscope.allocator import KVPool, PoolConfig
from kvscope.poolsummary import summary
from tests.forking import fork_child, wait_child

PROMPT = list(range(100, 109))  # two full blocks of 4, and one token


def test_a_prefix_held_only_by_another_process_is_counted_apart(pool_name):
    pool = KVPool.create(
        pool_name, PoolConfig(num_blocks=32, block_size=4, num_layers=1, head_dim=4, max_seqs=64)
    )
    r, w = os.pipe()
    r2, w2 = os.pipe()
    try:

        def publisher() -> int:
            with KVPool.attach(pool_name) as other:
                seq = other.allocate("first", PROMPT)
                other.mark_computed(seq, len(PROMPT))
                # while "first" lives, "second" of the parent hits its two full blocks
                os.write(w, b"x")
                os.read(r2, 1)
                other.free(seq)
            return 0

        child = fork_child(publisher, 30)
        os.read(r, 1)
        second = pool.allocate("second", PROMPT + [7])
        assert second.num_cached_tokens == 8
        os.write(w2, b"x")
        assert wait_child(child) == 0
        rows = {
            o["pid"]: o for o in summary(pool.view, lambda pid, start: False)["blocks_by_owner"]
        }
        assert rows[child]["blocks"] == 2 and rows[child]["requests"] == 0
        assert rows[child]["held_for_others"] == 2
        me = rows[os.getpid()]
        assert me["requests"] == 1 and me["held_for_others"] == 0
        pool.free(second)
    finally:
        pool.close()
        pool.unlink()
