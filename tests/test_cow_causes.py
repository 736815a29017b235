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


def _guarded_parent(monkeypatch, make_pool, written: int = 6):
    """Guard mode, a pool, and request 'p' of 6 tokens (two blocks, the second partial), the
    K/V of its first `written` positions stored."""
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = make_pool(num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=4)
    parent = pool.allocate("p", [1, 2, 3, 4, 5, 6])
    _write(pool, pool.slot_mapping(parent, 0, written))
    return pool, parent


def _write(pool, slots, value=1.0):
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    flat[:, :, slots] = value


@pytest.mark.parametrize("bug", ["none", "skip-copy", "stale-table"])
def test_a_copy_skipped_or_written_around_is_told_apart(probes, monkeypatch, make_pool, bug):
    pool, parent = _guarded_parent(monkeypatch, make_pool)
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


def test_a_copy_of_positions_never_written_in_its_source_is_not_blamed_on_the_copy(
    probes, monkeypatch, make_pool
):
    # GIVEN a parent whose positions 4-5 were never stored in its own block (its K/V went
    # into a sibling's slots, say), forked, and the fork's copy made as append asked
    pool, parent = _guarded_parent(monkeypatch, make_pool, written=4)  # positions 4-5: never
    child = pool.fork(parent, "c")
    ((src, dst),) = pool.append(child, [7])
    copy_blocks(pool.kv, torch.tensor([src]), torch.tensor([dst]), pool=pool)
    _write(pool, pool.slot_mapping(child, 6, 7))
    pool.free(child)
    pool.free(parent)
    # WHEN analyzed
    report = analyze_view(pool.view)
    # THEN both blocks are kv_never_written at positions 4-5, and the copy is not called
    # skipped: its source was never written there
    unwritten = {f["block"]: f for f in report["findings"] if f["kind"] == "kv_never_written"}
    assert set(unwritten) == {src, dst} and unwritten[dst]["copied_from"] == src
    (cause,) = report["likely_causes"]
    assert cause.startswith("copy-on-write copies of positions never written in their source")
    assert f"'c' block {dst} copied from {src}" in cause


def test_a_fork_writing_its_new_token_through_another_sequence_s_table_is_not_a_blank_copy(
    probes, monkeypatch, make_pool
):
    # GIVEN a parent and two forks sharing a partial block, each append's copy made, and the
    # forks writing their new token through the parent's table (into the parent's copy)
    pool, parent = _guarded_parent(monkeypatch, make_pool)
    kids = [pool.fork(parent, "c1"), pool.fork(parent, "c2")]
    made = {}
    for seq, tok in zip([parent, *kids], [7, 8, 9]):
        for src, dst in pool.append(seq, [tok]):
            copy_blocks(pool.kv, torch.tensor([src]), torch.tensor([dst]), pool=pool)
            made[seq.request_id] = (src, dst)
        _write(pool, pool.slot_mapping(parent, 6, 7))  # the forks' bug: the parent's table
    for seq in (parent, *kids):  # one more token each (a request's last position is not checked)
        pool.append(seq, [10])
        _write(pool, pool.slot_mapping(seq, 7, 8))
    for seq in (*kids, parent):
        pool.free(seq)
    # WHEN analyzed
    report = analyze_view(pool.view)
    # THEN c1's copy (its new token's position unwritten, as is the source's, which c2 kept)
    # is named as a write through another table, not as a copy of unwritten K/V
    src, dst = made["c1"]
    unwritten = {f["block"]: f for f in report["findings"] if f["kind"] == "kv_never_written"}
    assert unwritten[dst]["copied_from"] == src and src in unwritten
    (cause,) = report["likely_causes"]
    assert cause.startswith("K/V written through a block table from before pool.append")
    assert "into another sequence's block through its table" in cause
    assert f"'c1' block {dst} copied from {src}" in cause


def test_a_blank_position_in_a_block_a_fork_shares_names_the_request_that_finished(
    probes, monkeypatch, make_pool
):
    # GIVEN a sample 'c' whose copy-on-write copy the engine skipped (positions 4 and 5 of its
    # copy never written), and a sample 'd' forked from it afterwards, sharing that copy (the
    # copy's record names 'c', which allocated it)
    pool, parent = _guarded_parent(monkeypatch, make_pool)
    pool.mark_computed(parent, 6)
    child = pool.fork(parent, "c")
    ((src, dst),) = pool.append(child, [7])  # (the copy skipped)
    _write(pool, pool.slot_mapping(child, 6, 7))
    grandchild = pool.fork(child, "d")
    # WHEN 'd' finishes first
    pool.free(grandchild)
    # THEN its kv_never_written on the shared copy is about 'd', in its request as in its
    # message, not about the request whose record the block is
    found = [f for f in pool.findings() if f.kind == "kv_never_written"]
    assert [(f.block, f.request) for f in found] == [(dst, "d")]
    assert found[0].message.startswith("request 'd' finished with positions 4-5")
    pool.free(child)
    pool.free(parent)
    # AND the analysis knows the block as the copy 'c''s append made, and names the skipped copy
    report = analyze_view(pool.view)
    first = next(f for f in report["findings"] if f["kind"] == "kv_never_written")
    assert (first["request"], first["copied_from"]) == ("d", src)
    assert report["likely_causes"][0].startswith("copy-on-write copies not made")


@pytest.mark.parametrize("bug", ["none", "reversed", "untold"])
def test_a_copy_the_wrong_way_round_is_found_at_the_copy(
    probes, monkeypatch, make_pool, tmp_path, bug
):
    import re

    from kvscope.allocator.oplog import read_log
    from kvscope.replay import replay

    # GIVEN a request forked, whose append hands out a copy-on-write pair, recorded
    pool, parent = _guarded_parent(monkeypatch, make_pool)
    path = tmp_path / "cow.ops"
    pool.record_ops(str(path))
    child = pool.fork(parent, "p")
    ((src, dst),) = pool.append(child, [7])
    # WHEN the program copies it as handed out, the wrong way round (dst into src: the block
    # the parent still reads), or without telling the pool
    if bug == "none":
        copy_blocks(pool.kv, torch.tensor([src]), torch.tensor([dst]), pool=pool)
    elif bug == "reversed":
        copy_blocks(pool.kv, torch.tensor([dst]), torch.tensor([src]), pool=pool)
    else:
        copy_blocks(pool.kv, torch.tensor([src]), torch.tensor([dst]))
    pool.stop_recording()
    found = [f for f in pool.findings() if f.block == src]
    # THEN only the reversed copy is a finding, at the copy: the block it overwrote, held by
    # the parent's request, and the copy's line; the analysis names the cause
    if bug != "reversed":
        assert found == []
    else:
        (f,) = found
        assert (f.kind, f.request) == ("unmapped_write", "p")
        assert re.match(
            rf"a copy of block {dst} into block {src} at \S*test_cow_causes\.py:\d+ \S+: block"
            rf" {src} is no copy-on-write destination append handed out",
            f.message,
        ), f.message
        causes = analyze_view(pool.view)["likely_causes"]
        assert any(
            c.startswith("copy-on-write copies made into blocks append did not") for c in causes
        )
        # AND a replay of the log finds it again at the copy
        out = replay(read_log(str(path)), quiet=True)
        assert out.reason == "finding" and ("unmapped_write", src) in out.got.found, out
    pool.free(child)
    pool.free(parent)
