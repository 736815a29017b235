"""The report's likely causes (kvscope.analysis.likely_causes): a cause named when the findings
point at it together, and not from any one of them alone."""

from __future__ import annotations

import pytest

from kvscope.allocator import KVPool, PoolConfig
from kvscope.analysis import analyze_view, likely_causes

BS = 4


def _serve(pool: KVPool, slots_per_block: int) -> None:
    """Two requests written, published and freed, each slot computed as
    block * slots_per_block + offset on the flat K/V."""
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    for rid in ("a", "b"):
        seq = pool.allocate(rid, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16 if rid == "a" else 17])
        for pos, tok in enumerate(seq.tokens):
            flat[:, :, seq.block_table[pos // BS] * slots_per_block + pos % BS] = float(tok)
        pool.mark_computed(seq, len(seq.tokens))
        pool.free(seq)


@pytest.mark.parametrize("formula", ["block_size", "slots_per_block"])
def test_a_slot_computed_with_block_size_in_guard_mode_is_named(pool_name, monkeypatch, formula):
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=16, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=4),
    )
    try:
        assert pool.slots_per_block == BS + 1
        _serve(pool, BS if formula == "block_size" else pool.slots_per_block)
        pool.verify()
        report = analyze_view(pool.view)
    finally:
        pool.close()
        pool.unlink()
    kinds = {f["kind"] for f in report["findings"]}
    if formula == "block_size":
        assert "guard_violation" in kinds
        assert (
            report["likely_causes"] and "block * block_size + offset" in report["likely_causes"][0]
        )
    else:
        assert not report["findings"]
        assert "likely_causes" not in report


GUARD = {"block_size": 4, "slots_per_block": 5}


def _f(kind: str, message: str = "") -> dict[str, str]:
    return {"kind": kind, "message": message}


def test_no_cause_is_named_from_one_kind_alone_or_without_guard_slots():
    assert likely_causes(GUARD, [_f("guard_violation")]) == []
    assert likely_causes(GUARD, [_f("kv_never_written")]) == []
    plain = {"block_size": 4, "slots_per_block": 4}
    assert likely_causes(plain, [_f("guard_violation"), _f("kv_never_written")]) == []
    # a published block changed since it was written is not an unwritten one
    changed = _f("published_block_modified", "K/V changed since request 'a' published it")
    assert likely_causes(GUARD, [_f("guard_violation"), changed]) == []
    blank = _f("published_block_modified", "published before its K/V was written: ...")
    assert likely_causes(GUARD, [_f("guard_violation"), blank])
