"""Writes into blocks the writer does not own are findings: a published block's K/V changing
(digest), a freed block written in quarantine (poison), a guard canary overwritten anywhere,
seen as operations run and by `check` / `analyze` of a live CPU pool or a `--with-data` dump."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.allocator import KVPool
from kvscope.allocator.events import events_for_block
from kvscope.cli import main


def write_kv(pool: KVPool, blocks: list[int], seed: int = 0) -> None:
    """Fill the token slots of `blocks` with K/V (what an engine's prefill writes)."""
    gen = torch.Generator().manual_seed(seed)
    shape = pool.kv[:, :, blocks, : pool.block_size].shape
    pool.kv[:, :, blocks, : pool.block_size] = torch.randn(shape, generator=gen)


def published(pool: KVPool) -> tuple[object, int]:
    """A request whose first two blocks hold K/V and are published; its second block."""
    seq = pool.allocate("owner", list(range(9)))
    write_kv(pool, seq.block_table)
    assert pool.mark_computed(seq, 8) == 2
    return seq, seq.block_table[1]


def modified(pool: KVPool) -> list:
    return [f for f in pool.findings() if f.kind == "published_block_modified"]


def test_an_untouched_published_block_is_no_finding(make_pool, probes):
    # GIVEN published blocks nobody writes, WHEN hit, evicted, checked, THEN nothing is found
    pool = make_pool(16)
    seq, _ = published(pool)
    other = pool.allocate("hit", list(range(8)) + [50])
    pool.free(other)
    pool.free(seq)
    assert pool.evict(16) == 2
    assert not modified(pool) and pool.check() == []


@pytest.mark.parametrize(
    "when,seen",
    [
        ("prefix hit", "seen at a prefix hit by request 'hit'"),
        ("release", "seen at its release by request 'owner'"),
        ("eviction", "seen at its eviction"),
        ("check", "seen at a check"),
    ],
)
def test_a_write_into_a_published_block_is_found(make_pool, probes, when, seen):
    # GIVEN a published block whose K/V something overwrites afterwards (while its request
    # holds it, for the release; once it is only cached, otherwise)
    pool = make_pool(16)
    seq, blk = published(pool)
    if when != "release":
        pool.free(seq)
    pool.kv[0, 1, blk, 2, 0, 3] += 1.0
    # WHEN the pool next looks at it
    if when == "prefix hit":
        pool.allocate("hit", list(range(8)) + [50])
    elif when == "release":
        pool.free(seq)
    elif when == "eviction":
        pool.evict(16)
    found = modified(pool) if when != "check" else pool.check()
    # THEN it is an error naming the block, the process and request that published it
    assert [f.kind for f in found] == ["published_block_modified"], found
    assert (found[0].block, found[0].owner_pid, found[0].request) == (blk, pool.pid, "owner")
    assert found[0].severity == "error" and seen in found[0].message
    # AND its message says the request was the block's publisher, not who wrote
    assert "since request 'owner' published it" in found[0].message
    assert found[0].message.endswith("a request that mapped it since (its prefix_hit events)")


@pytest.mark.parametrize("rid", ["owner", "it's", "a\\b", "caf\u00e9", "tab\there"])
def test_a_release_names_its_request_as_its_repr(make_pool, probes, rid):
    # GIVEN a request (an id the core words itself, or one whose repr escapes or quotes
    # otherwise) whose published block's K/V something overwrote while it held it
    pool = make_pool(16)
    seq = pool.allocate(rid, list(range(9)))
    write_kv(pool, seq.block_table)
    assert pool.mark_computed(seq, 8) == 2
    pool.kv[0, 1, seq.block_table[1], 2, 0, 3] += 1.0
    # WHEN it is released
    pool.free(seq)
    # THEN the finding names the moment with the request's repr, as Python writes it
    (found,) = modified(pool)
    assert f"seen at its release by request {rid!r}" in found.message


def test_a_write_found_at_an_eviction_reaches_on_finding(make_pool, probes):
    # GIVEN a cached published block whose K/V something overwrote, and a findings callback
    pool = make_pool(16)
    seq, blk = published(pool)
    pool.free(seq)
    pool.kv[0, 1, blk, 2, 0, 3] += 1.0
    seen: list = []
    pool.on_finding = seen.append
    # WHEN it is evicted (by the C core, which writes the finding into the ring)
    assert pool.evict(16) == 2
    # THEN the callback got it, as the ring has it
    assert [(f.kind, f.block) for f in seen] == [("published_block_modified", blk)]
    assert [(f.kind, f.block) for f in modified(pool)] == [("published_block_modified", blk)]


def test_a_block_published_before_its_kv_was_written_is_named_so(make_pool, probes):
    # GIVEN a prompt published right after allocate, its K/V written afterwards (an engine
    # that calls mark_computed before prefill)
    pool = make_pool(16)
    seq = pool.allocate("early", list(range(9)))
    assert pool.mark_computed(seq, 8) == 2
    write_kv(pool, seq.block_table)
    # WHEN a second request hits the prefix
    pool.allocate("hit", list(range(8)) + [50])
    # THEN both published blocks are found, and the message says what happened
    found = modified(pool)
    assert sorted(f.block for f in found) == sorted(seq.block_table[:2])
    assert all("published before its K/V was written" in f.message for f in found)
    # (an ordinary overwrite of written K/V does not say so)
    pool2 = make_pool(16)
    seq2, blk = published(pool2)
    pool2.kv[0, 1, blk, 2, 0, 3] += 1.0
    pool2.free(seq2)
    assert [("published before" in f.message) for f in modified(pool2)] == [False]


def test_a_digest_from_an_older_allocation_of_the_block_never_counts(make_pool, probes):
    # GIVEN a published block evicted, then allocated again and written with other K/V
    pool = make_pool(4)
    seq, blk = published(pool)
    pool.free(seq)
    pool.evict(4)
    again = pool.allocate("again", list(range(100, 116)))
    assert blk in again.block_table
    write_kv(pool, again.block_table, seed=1)
    # WHEN it is checked before being published again, THEN its old digest is not used
    assert pool.check() == []


def test_analyze_of_a_dump_with_data_and_of_the_live_pool_find_the_write(
    make_pool, probes, tmp_path, capsys
):
    # GIVEN a live CPU pool with a published block overwritten (no operation touched it since)
    pool = make_pool(16)
    _, blk = published(pool)
    pool.kv[1 - 1, 0, blk, 0, 0, 0] = 7.0
    dump = str(tmp_path / "pool.kvd")
    assert main(["dump", pool.name, "-o", dump, "--with-data"]) == 0
    capsys.readouterr()
    # WHEN analyzed live, checked live, and analyzed from the dump
    for argv in (["analyze", pool.name, "--json"], ["check", pool.name, "--json"],
                 ["analyze", dump, "--json"]):  # fmt: skip
        code = main(argv)
        report = json.loads(capsys.readouterr().out)
        # THEN each reports published_block_modified for the block, exit 1
        kinds = {(f["kind"], f["block"]) for f in report["findings"]}
        assert code == 1 and ("published_block_modified", blk) in kinds, (argv, kinds)
    # AND a dump without the data has nothing to check it against
    bare = str(tmp_path / "bare.kvd")
    assert main(["dump", pool.name, "-o", bare]) == 0
    assert main(["analyze", bare]) == 0


def test_a_write_after_free_is_found_before_reuse_naming_who_freed_it(make_pool, probes):
    # GIVEN a guard-mode pool: a request's blocks are freed (poisoned, in quarantine) and then
    # one token's K/V is written through the table the engine kept
    pool = make_pool(8, guard=True)
    seq = pool.allocate("freed", list(range(6)))
    table = list(seq.block_table)
    pool.free(seq)
    pool.kv[:, :, table[1], 1] = 0.5  # slot 1 of the stale table's second block
    # WHEN the pool is checked, THEN a use_after_free names the block and who freed it
    (f,) = [f for f in pool.check() if f.kind == "use_after_free"]
    assert (f.block, f.owner_pid, f.request) == (table[1], pool.pid, "freed")
    assert "written after it was freed" in f.message
    # AND when the block is handed out again, the probe reports it before reuse
    pool.allocate("next", list(range(100, 100 + 4 * 8 - 3)))
    (live,) = [f for f in pool.findings() if f.kind == "use_after_free"]
    assert (live.block, live.request) == (table[1], "freed")
    # AND the block's history says who freed it and when
    frees = [e for e in events_for_block(pool.view, table[1]) if e["op"] == "free"]
    assert (frees[-1]["pid"], frees[-1]["request"]) == (pool.pid, "freed")


def write_positions(pool: KVPool, seq, first: int, last: int) -> None:
    """Write K/V for positions [first, last] of seq through its current table."""
    for pos in range(first, last + 1):
        blk = seq.block_table[pos // pool.block_size]
        pool.kv[:, :, blk, pos % pool.block_size] = float(pos)


def unwritten(pool: KVPool) -> list:
    return [f for f in pool.findings() if f.kind == "kv_never_written"]


def test_a_copy_on_write_copy_the_engine_skipped_is_found_when_the_request_finishes(
    make_pool, probes
):
    # GIVEN a guard-mode pool, a 6-token request forked, and the parent's append copying the
    # shared partial block: an engine that skips the copy and writes the new token through
    # the table it had before
    pool = make_pool(16, guard=True)
    seq = pool.allocate("parent", list(range(6)))
    write_positions(pool, seq, 0, 5)
    kid = pool.fork(seq, "kid")
    old = list(seq.block_table)
    ((src, dst),) = pool.append(seq, [6])
    pool.kv[:, :, old[1], 6 % pool.block_size] = 6.0  # into src: the kid's block now
    pool.append(seq, [7])
    write_positions(pool, seq, 7, 7)
    # WHEN both requests finish
    pool.free(kid)
    pool.free(seq)
    # THEN the parent's copy is found, naming its block and the positions never written
    (f,) = unwritten(pool)
    assert (f.block, f.request, f.severity) == (dst, "parent", "error")
    assert "positions 4-6" in f.message


def test_an_engine_that_writes_everything_aborts_or_ends_early_has_no_unwritten_finding(
    make_pool, probes
):
    # GIVEN a guard-mode pool and an engine doing it right: the copy performed, every position
    # written; plus a request aborted before its prefill and one ended before its last token
    pool = make_pool(16, guard=True)
    seq = pool.allocate("parent", list(range(6)))
    write_positions(pool, seq, 0, 5)
    kid = pool.fork(seq, "kid")
    ((src, dst),) = pool.append(seq, [6])
    pool.kv[:, :, dst] = pool.kv[:, :, src]
    write_positions(pool, seq, 6, 6)
    aborted = pool.allocate("aborted", list(range(50, 60)))
    no_kv = pool.allocate("no-kv", list(range(80, 90)))  # a scheduler test writes no K/V
    early = pool.allocate("early", list(range(70, 75)))
    write_positions(pool, early, 0, 3)  # its last position's K/V never fed back
    # WHEN they end
    for s in (kid, seq, early, no_kv):
        pool.free(s)
    pool.abort(aborted)
    # THEN nothing is reported
    assert unwritten(pool) == []


def test_guard_canaries_of_held_and_cached_blocks_are_verified(make_pool, probes):
    # GIVEN a guard-mode pool with a held block and a cached one whose guard slots were hit
    pool = make_pool(16, guard=True)
    held = pool.allocate("held", list(range(5)))
    cached, blk = published(pool)
    pool.free(cached)
    pool.kv[0, 0, held.block_table[0], pool.block_size] = 1.0
    pool.kv[0, 1, blk, pool.block_size] = 1.0
    # WHEN the pool is verified and checked (no block was freed since)
    verified = {f.block for f in pool.verify() if f.kind == "guard_violation"}
    checked = {f.block for f in pool.check() if f.kind == "guard_violation"}
    # THEN both blocks are guard violations
    assert verified == checked == {held.block_table[0], blk}
    pool.free(held)


def test_verify_scans_a_cpu_pools_canaries_in_the_core_once_per_block(
    make_pool, probes, monkeypatch
):
    # GIVEN a guard-mode CPU pool (the core maps its K/V), whose Python scan may not run, and a
    # held block whose guard slot was hit
    from kvscope.allocator import integrity

    monkeypatch.setattr(integrity, "broken_canaries", lambda *a, **k: pytest.fail("scanned"))
    pool = make_pool(16, guard=True)
    held = pool.allocate("held", list(range(5)))
    blk = held.block_table[0]
    assert pool.verify() == []
    pool.kv[0, 1, blk, pool.block_size] = 1.0
    # WHEN the pool is verified, twice
    (f,) = pool.verify()
    again = pool.verify()
    # THEN the core's scan reports the block once, with its owner and request, into the ring
    assert (f.kind, f.block, f.request, f.owner_pid) == ("guard_violation", blk, "held", pool.pid)
    assert again == []
    assert [(g.kind, g.block) for g in pool.findings()] == [("guard_violation", blk)]
    pool.kv[0, 1, blk, pool.block_size] = pool.kv[0, 0, blk, pool.block_size]
    pool.free(held)


@pytest.mark.gpu
def test_on_a_cuda_pool_the_digest_kernel_and_the_poison_check_find_the_writes(pool_name, probes):
    # GIVEN a guard-mode CUDA pool (the digest runs as a Triton kernel there)
    from kvscope.allocator import PoolConfig

    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=16, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                   dtype="bfloat16", device="cuda", guard=True),
    )  # fmt: skip
    try:
        seq = pool.allocate("owner", list(range(33)))
        pool.kv[:, :, seq.block_table, :16] = torch.randn(
            pool.kv[:, :, seq.block_table, :16].shape, device="cuda"
        ).to(pool.kv.dtype)
        assert pool.mark_computed(seq, 32) == 2
        freed = pool.allocate("freed", [7] * 20)
        stale = freed.block_table[-1]
        pool.free(freed)
        # WHEN a published block and a freed one are written, and the pool is checked
        pool.kv[1, 0, seq.block_table[1], 3, 1, 5] += 1.0
        pool.kv[0, 1, stale, 2] = 0.0
        found = {(f.kind, f.block, f.request) for f in pool.check()}
        # THEN both writes are findings, named by block and request
        assert ("published_block_modified", seq.block_table[1], "owner") in found
        assert ("use_after_free", stale, "freed") in found
        pool.free(seq)
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("blank", [False, True])
def test_where_a_change_was_seen_comes_apart_and_back_together(blank):
    from kvscope.allocator.integrity import (
        BLANK_MODIFIED_MESSAGE,
        MODIFIED_MESSAGE,
        seen_apart,
        seen_together,
    )

    # GIVEN the message of a change seen at a hit by a request whose name has "(seen at " in it
    def said(when: str) -> str:
        if blank:
            return BLANK_MODIFIED_MESSAGE.format(blank="zero", when=when, found=0x1234)
        return MODIFIED_MESSAGE.format(published="request 'p (seen at x)' published it", when=when)

    hit = "a prefix hit by request 'r (seen at )'"
    # WHEN taken apart THEN the words are the same for another place, and put back together
    # with both places
    words, place = seen_apart(said(hit))
    assert place == hit and seen_apart(said("its eviction")) == (words, "its eviction")
    assert seen_together(words, [hit]) == said(hit)
    assert seen_together(words, [hit, "its eviction"]) == said(f"{hit} and at its eviction")
    # a message cut short (the ring keeps 200 bytes) is not taken apart
    assert seen_apart(said(hit)[:-3]) is None
