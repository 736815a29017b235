"""kv_never_written on a copy-on-write copy (kvscope.analysis.copied_from): the report names
the copy the finding's block was made from and tells a copy the engine skipped (the block's
first positions unwritten) from a write through the table from before the append (the new
token's position unwritten: it went into the shared source, which the siblings read)."""

from __future__ import annotations

import pytest
import torch

from kvscope.analysis import analyze_view
from kvscope.kernels import copy_blocks

BS = 4


def _write(pool, slots, value=1.0):
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    flat[:, :, slots] = value


@pytest.mark.parametrize("bug", ["none", "skip-copy", "stale-table"])
def test_a_copy_skipped_or_written_around_is_told_apart(probes, monkeypatch, make_pool, bug):
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = make_pool(num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=4)
    parent = pool.allocate("p", [1, 2, 3, 4, 5, 6])
    _write(pool, pool.slot_mapping(parent, 0, 6))
    pool.mark_computed(parent, 6)
    child = pool.fork(parent, "c")
    before = list(child.block_table)
    copies = pool.append(child, [7])
    assert len(copies) == 1
    src, dst = copies[0]
    if bug != "skip-copy":
        copy_blocks(pool.kv, torch.tensor([src]), torch.tensor([dst]), pool=pool)
    if bug == "stale-table":
        _write(pool, [before[1] * pool.slots_per_block + 2])  # position 6 through the old table
    else:
        _write(pool, pool.slot_mapping(child, 6, 7))
    pool.append(child, [8])
    _write(pool, pool.slot_mapping(child, 7, 8))
    pool.free(child)
    pool.free(parent)
    report = analyze_view(pool.view)
    causes = report.get("likely_causes", [])
    if bug == "none":
        assert not report["findings"] and not causes
        return
    (found,) = [f for f in report["findings"] if f["kind"] == "kv_never_written"]
    assert found["request"] == "c" and found["block"] == dst
    assert found["copied_from"] == src
    (cause,) = causes
    assert f"'c' block {dst} copied from {src}" in cause
    if bug == "skip-copy":
        assert cause.startswith("copy-on-write copies not made")
    else:
        assert cause.startswith("K/V written through a block table from before pool.append")
