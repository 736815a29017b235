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
    # the resume handed the same block back: the request's own again, not lost
    for took in ("allocate", "prefix_hit"):
        back = _f("unmapped_write", "a", "", ["allocate", "preempt", "free", took])
        assert likely_causes(GUARD, [back]) == []
        again = _f("unmapped_write", "a", "", ["allocate", "preempt", took, "preempt"])
        assert likely_causes(GUARD, [again])
    stored_back = _f(
        "published_block_modified",
        "a",
        "request 'a' stored K/V into block 3 at x:1",
        ["allocate", "preempt", "allocate", "publish"],
    )
    assert all("lost to a preemption" not in c for c in likely_causes(GUARD, [stored_back]))
    stored = _f(
        "published_block_modified",
        "a",
        "request 'a' stored K/V into block 3 at x:1",
        ["allocate", "preempt"],
    )
    assert likely_causes(GUARD, [stored])


def _write(pool, table, seq, start, end):
    """The K/V of positions [start, end) of seq stored through `table` (no writers given)."""
    spb, bs = pool.slots_per_block, pool.block_size
    slots = torch.tensor([table[p // bs] * spb + p % bs for p in range(start, end)])
    pool.kv[:, :, slots // spb, slots % spb] = 1.0


@pytest.mark.parametrize("after_resume", ["stale", "none", "reread"])
def test_a_resume_whose_positions_stay_unwritten_names_the_preemption(
    probes, make_pool, after_resume
):
    # GIVEN a request computed and published, preempted by another's allocation, resumed
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4, guard=True)
    a = pool.allocate("a", list(range(10)))
    _write(pool, a.block_table, a, 0, 10)
    pool.mark_computed(a, 10)
    old = list(a.block_table)
    pool.set_state(a, "waiting")
    b = pool.allocate("b", list(range(100, 124)))  # takes every block: a is preempted
    assert a.state == "preempted"
    _write(pool, b.block_table, b, 0, 24)
    pool.free(b)
    cached = pool.resume(a)
    assert cached < 10 and a.block_table[cached // 4] not in old  # a block of its own again
    # WHEN the engine writes a's positions from its cached tokens on through the table from
    # before the preemption (the bug), not at all (the bug too), or through the table now
    if after_resume != "none":
        table = old if after_resume == "stale" else pool.block_table(a)
        _write(pool, table, a, cached, 10)
    pool.free(a)  # guard mode: its positions still poisoned are kv_never_written
    report = analyze_view(pool.view)
    # THEN the resume is named as the cause, the blocks its preemption released with it
    if after_resume == "reread":
        assert "likely_causes" not in report and not report["findings"]
        return
    unwritten = [f for f in report["findings"] if f["kind"] == "kv_never_written"]
    assert unwritten and all(f["request"] == "a" for f in unwritten)
    assert set(unwritten[0]["preempted_blocks"]) == set(old)
    (cause,) = report["likely_causes"]
    assert cause.startswith("requests preempted and resumed finished with positions never")
    assert "'a' block" in cause and "after pool.resume(seq), recompute" in cause.lower()


def test_a_resume_reserves_the_sequence_under_a_new_id(probes, make_pool):
    # GIVEN a sequence preempted by another's allocation (docs/POOL.md: a sequence id names
    # one reservation, not one request)
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", list(range(8)))
    first = a.seq_id
    pool.set_state(a, "waiting")
    b = pool.allocate("b", list(range(100, 128)))
    assert a.state == "preempted"
    pool.free(b)
    # WHEN it is resumed
    pool.resume(a)
    # THEN the same Sequence and request id, under a new, larger sequence id
    assert a.request_id == "a" and a.seq_id > first
    pool.free(a)


def test_a_resume_s_prefix_hit_on_a_block_never_fully_written_is_not_named_the_resume_s(
    probes, make_pool
):
    # GIVEN a request whose prefill skipped one position of its first block, published, then
    # preempted (its published blocks stay cached) and resumed through a prefix hit on them
    pool = make_pool(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4, guard=True)
    a = pool.allocate("a", list(range(10)))
    _write(pool, a.block_table, a, 0, 2)
    _write(pool, a.block_table, a, 3, 10)  # position 2 never stored: the bug
    pool.mark_computed(a, 8)
    hit = list(a.block_table[:2])
    pool.set_state(a, "waiting")
    b = pool.allocate("b", list(range(100, 124)))
    assert a.state == "preempted"
    _write(pool, b.block_table, b, 0, 24)
    pool.free(b)
    assert pool.resume(a) == 8 and list(a.block_table[:2]) == hit
    _write(pool, a.block_table, a, 8, 10)
    # WHEN it finishes (guard mode: position 2 still poisoned)
    pool.free(a)
    report = analyze_view(pool.view)
    # THEN the block is kv_never_written, not a block its resume wrote through an old table:
    # the resume mapped it by a prefix hit, holding what was written before the preemption
    (found,) = [f for f in report["findings"] if f["kind"] == "kv_never_written"]
    assert found["block"] == hit[0] and "preempted_blocks" not in found
    causes = report.get("likely_causes", [])
    assert not any(c.startswith("requests preempted and resumed") for c in causes)
