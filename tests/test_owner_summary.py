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


def test_free_blocks_in_a_process_s_local_cache_are_counted_apart_from_held(pool_name):
    # GIVEN a process that holds one request of 3 blocks and freed another of 2 blocks, whose
    # unpublished blocks went to its local cache (free, but no other process can take them)
    pool = KVPool.create(
        pool_name, PoolConfig(num_blocks=32, block_size=4, num_layers=1, head_dim=4, max_seqs=64)
    )
    try:
        held = pool.allocate("held", list(range(9)))
        gone = pool.allocate("gone", list(range(50, 56)))
        pool.free(gone)
        local = pool.stats()["num_local"]
        assert local >= 2
        # WHEN the summary and its text are made
        s = summary(pool.view, lambda pid, start: True)
        me = next(o for o in s["blocks_by_owner"] if o["pid"] == os.getpid())
        # THEN the owner's local cache is counted apart from the blocks its requests hold
        assert me["blocks"] == 3 + local and me["local"] == local
        from io import StringIO

        from rich.console import Console

        from kvscope.analysis import analyze_view
        from kvscope.report import render

        out = StringIO()
        render(analyze_view(pool.view, alive=lambda pid, start: True), Console(file=out, width=200))
        line = next(x for x in out.getvalue().splitlines() if x.strip().startswith(str(me["pid"])))
        assert line.split()[2:] == ["3", "1", str(local)], line
        pool.free(held)
    finally:
        pool.close()
        pool.unlink()
