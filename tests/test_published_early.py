"""A block published before its K/V was written and read by a later prefix hit: the
published_block_modified finding ("published before its K/V was written") and the hit's
foreign_slot ("written since its publication") on the same block are one cause, named once
(kvscope.analysis.likely_causes), and a foreign_slot elsewhere is not tied to it."""

from __future__ import annotations

import pytest

from kvscope.analysis import analyze_view, likely_causes

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]

GEO = {"block_size": 4, "slots_per_block": 5}
# block 1 published blank by 'a'; a prefix hit of 'b' that read block 2 changed since
BLANK = {
    "kind": "published_block_modified",
    "block": 1,
    "request": "a",
    "message": "published before its K/V was written: ...",
}
HIT = {
    "kind": "foreign_slot",
    "block": 2,
    "request": "b",
    "message": "a prefix hit: slot 0 of block 2 ... was written since its publication: ...",
}


def _write(pool, seq, start, end):
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    for p, slot in zip(range(start, end), pool.slot_mapping(seq, start, end)):
        flat[:, :, slot] = float(seq.tokens[p])


@pytest.mark.parametrize("early", [False, True])
def test_a_prefix_published_before_its_kv_is_one_cause(probes, monkeypatch, make_pool, early):
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_PROVENANCE_SAMPLE", "1")
    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", PROMPT)
    if early:
        pool.mark_computed(a, len(PROMPT))
    _write(pool, a, 0, len(PROMPT))
    if not early:
        pool.mark_computed(a, len(PROMPT))
    b = pool.allocate("b", PROMPT + [20])  # hits a's two full blocks
    assert b.num_cached_tokens == 8
    _write(pool, b, 8, 10)
    pool.free(a)
    pool.free(b)
    report = analyze_view(pool.view)
    causes = report.get("likely_causes", [])
    if not early:
        assert not report["findings"] and not causes
        return
    kinds = {f["kind"] for f in report["findings"]}
    assert {"published_block_modified", "foreign_slot"} <= kinds
    (cause,) = causes
    assert cause.startswith("blocks published before their K/V was written ('a' blocks")
    assert "('b' block" in cause and "pool.mark_computed(seq, n) only once" in cause


def test_a_foreign_slot_on_another_block_is_not_tied_to_an_early_publication():
    # the early publication is named alone, without the hit on another block
    (alone,) = likely_causes(GEO, [BLANK, HIT])
    assert alone.startswith("blocks published before their K/V was written ('a' block 1):")
    assert "'b'" not in alone and "a prefix hit in between reads K/V nobody wrote" in alone
    (tied,) = likely_causes(GEO, [BLANK, dict(HIT, block=1)])
    assert "read by prefix hits as changed since ('b' block 1)" in tied


def test_the_publishers_own_stores_into_published_blocks_are_the_same_early_publication():
    # GIVEN an engine whose prefill publishes before it stores: one block found published
    # blank, the store probe naming the publisher as the writer into two more, and a prefix
    # hit that read one of those two changed since its publication
    stores = [
        {
            "kind": "published_block_modified",
            "block": b,
            "request": r,
            "message": f"request {r!r} stored K/V into block {b} at e.py:9 store: published by"
            f" request {r!r} (pid 7), shared by prefix hits",
        }
        for r, b in (("a", 1), ("c", 2), ("d", 3))
    ]
    # WHEN the causes are named
    (cause,) = likely_causes(GEO, [BLANK, *stores, HIT])
    # THEN they are one early publication, every publisher's block named once, the hit its
    # reader; not also a late store of a decode step
    assert cause.startswith(
        "blocks published before their K/V was written ('a' block 1, 'c' block 2, 'd' block 3)"
    )
    assert "read by prefix hits as changed since ('b' block 2)" in cause


def test_one_change_two_processes_saw_is_one_finding_naming_both_hits(probes, make_pool):
    # GIVEN block 0 published blank by 'a' and written after, then read by a prefix hit in this
    # process and one in another process attached to the pool (each process's core records
    # the change it saw)
    import multiprocessing as mp

    from kvscope.allocator.findingset import pool_findings

    pool = make_pool(num_blocks=32, block_size=4, num_kv_heads=1, head_dim=4)
    a = pool.allocate("a", PROMPT)
    pool.mark_computed(a, len(PROMPT))
    _write(pool, a, 0, len(PROMPT))
    pool.free(pool.allocate("b", PROMPT + [20]))
    proc = mp.get_context("spawn").Process(target=_hit, args=(pool.name, "c"))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    pool.free(a)
    # WHEN every reader's one rule assembles the pool's findings
    found = [f for f in pool_findings(pool.view).findings if f.kind == "published_block_modified"]
    # THEN each block's change is one finding, naming both hits, the first's first
    assert sorted(f.block for f in found) == sorted({f.block for f in found}) != []
    for f in found:
        assert f.request == "a" and f.extra["seen_at"] == [
            "a prefix hit by request 'b'",
            "a prefix hit by request 'c'",
        ], f.message
        assert "(seen at a prefix hit by request 'b' and at a prefix hit by request 'c';" in (
            f.message
        )


def _hit(name: str, request: str) -> None:
    from kvscope.allocator import KVPool

    pool = KVPool.attach(name)
    pool.free(pool.allocate(request, PROMPT + [21]))
    pool.close()
