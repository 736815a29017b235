"""A block table kept across a preemption (kvscope.analysis.lost_to_preemption): K/V an engine
writes after `pool.resume` through the table it had before the preemption lands in blocks the
request lost; the report names that cause (docs/CLI.md `likely_causes`), and not for a write
after free that no preemption freed."""

from __future__ import annotations

import pytest
import torch

from kvscope.analysis import analyze_view, likely_causes
from kvscope.kernels import store_kv
from kvscope.probes.stores import Writers

GUARD = {"block_size": 4, "slots_per_block": 5}


@pytest.mark.parametrize("reread", [False, True])
def test_a_table_kept_across_a_preemption_is_named(probes, make_pool, reread):
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", list(range(8)))
    table = list(a.block_table)
    pool.set_state(a, "waiting")
    b = pool.allocate("b", list(range(100, 128)))  # needs a's blocks: a is preempted
    assert a.state == "preempted"
    pool.free(b)
    pool.resume(a)
    if reread:
        table = list(a.block_table)
    assert reread or set(table) != set(a.block_table)  # the bug: a stale table
    spb = pool.slots_per_block
    slots = torch.tensor([table[p // 4] * spb + p % 4 for p in range(8)])
    k = torch.ones(8, 1, 4)
    store_kv(k, k, pool.kv[0, 0], pool.kv[0, 1], slots, writers=Writers(pool, [(a, 0, 8)]))
    report = analyze_view(pool.view)
    pool.free(a)
    if reread:
        assert not report["findings"]
        assert "likely_causes" not in report
        return
    assert {f["kind"] for f in report["findings"]} & {"use_after_free", "unmapped_write"}
    (cause,) = report["likely_causes"]
    assert "lost to a preemption ('a' block" in cause
    assert "after pool.resume" in cause


def _f(kind, request, message, ops):
    events = [
        {"op": op, "request": request, "time_ns": t, "block": 3} for t, op in enumerate(ops, 1)
    ]
    return {
        "kind": kind,
        "request": request,
        "block": 3,
        "message": message,
        "time_ns": len(ops) + 1,
        "events": events,
    }


def test_no_preemption_or_no_write_into_a_lost_block_names_nothing():
    # a write after free of a block its request freed, not lost to a preemption
    assert likely_causes(GUARD, [_f("use_after_free", "a", "", ["allocate", "free"])]) == []
    # a preempted request whose K/V was left unwritten: other causes (a skipped copy)
    unwritten = _f("kv_never_written", "a", "", ["allocate", "preempt", "allocate"])
    assert likely_causes(GUARD, [unwritten]) == []
    # a digest change names the block's publisher, not its writer
    changed = _f("published_block_modified", "a", "K/V changed since", ["allocate", "preempt"])
    assert likely_causes(GUARD, [changed]) == []
    # the preemption came after the write
    late = _f("unmapped_write", "a", "", ["allocate"])
    late["events"].append({"op": "preempt", "request": "a", "time_ns": 99, "block": 3})
    assert likely_causes(GUARD, [late]) == []
    lost = _f("unmapped_write", "a", "", ["allocate", "preempt"])
    assert likely_causes(GUARD, [lost])
    stored = _f(
        "published_block_modified",
        "a",
        "request 'a' stored K/V into block 3 at x:1",
        ["allocate", "preempt"],
    )
    assert likely_causes(GUARD, [stored])
