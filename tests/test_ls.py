"""kvscope ls: its occupancy columns account for every block, and it says when it read them."""

from __future__ import annotations

import json
import time

from kvscope.cli import main

COUNTS = ("num_held", "num_cached", "num_local", "num_quarantined", "num_free")


def every_state(pool) -> object:
    """A 16-block pool with blocks in every state: 2 allocated, 1 cached, 1 in this process's
    local cache, 3 quarantined (freed while leased), 9 free. Returns the lease (held)."""
    a = pool.allocate("a", list(range(12)))
    lease = pool.lease(a, "read", holder="offloader")
    pool.free(a)
    pool.free(pool.allocate("b", list(range(100, 108))))
    c = pool.allocate("c", list(range(200, 204)))
    pool.mark_computed(c, 4)
    pool.free(c)
    pool.allocate("d", list(range(300, 308)))
    return lease


def test_ls_columns_add_up_to_the_pool_s_blocks(capsys, make_pool):
    # GIVEN a pool with blocks allocated, cached, in a local cache, quarantined and free
    pool = make_pool(16)
    lease = every_state(pool)
    # WHEN ls lists it as JSON
    before = time.time_ns()
    assert main(["ls", "--json"]) == 0
    after = time.time_ns()
    (row,) = [r for r in json.loads(capsys.readouterr().out) if r["name"] == pool.name]
    # THEN held is the allocated blocks (not the local cache), each state has its own count,
    # and the counts add up to the pool's size
    got = [row[k] for k in COUNTS]
    assert got == [2, 1, 1, 3, 9]
    assert row["num_allocated"] == row["num_held"] and row["num_blocks"] == 16 == sum(got)
    assert row["utilization"] == row["num_held"] / 16
    # AND the row says when its snapshot was read
    assert before <= row["read_ns"] <= after
    # WHEN it lists it as text
    assert main(["ls"]) == 0
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if x.startswith(pool.name + " ")]
    # THEN the columns say the same, the percentage that of the count shown
    assert out[0].split()[3:8] == ["held", "cached", "local", "quarantined", "free"]
    after_geometry = line.split(" float32 ", 1)[1].split()
    assert after_geometry[:6] == ["2", "(12%)", "1", "1", "3", "9"], line
    # AND under the table, the time the pools were read
    assert out[-1].startswith("read ")
    lease.release()
